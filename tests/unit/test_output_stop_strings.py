"""StopStringMatcher: stop strings split across deltas, overlapping stop strings, hold-back and flush."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.output.stop_strings import StopStringMatcher


def run(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool, list[str]]:
    """Feeds the deltas until a match; returns (all text emitted, matched, per-call outputs)."""
    outputs: list[str] = []
    for delta in deltas:
        text, matched = matcher.feed(delta)
        outputs.append(text)
        if matched:
            return "".join(outputs), True, outputs
    outputs.append(matcher.flush())
    return "".join(outputs), False, outputs


def reference(text: str, stop: list[str], include: bool) -> tuple[str, bool]:
    """Character by character: the first stop string to complete wins, the longest on a tie."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[:end] if include else text[:end - len(s)], True
    return text, False


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


TEXT = "The answer is 42.\nObservation: done"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("cut", range(1, len(TEXT)))
def test_stop_string_split_at_every_position(cut, include):
    stop = "\nObservation:"
    emitted, matched, outputs = run(StopStringMatcher([stop], include), [TEXT[:cut], TEXT[cut:]])
    assert matched
    assert emitted == ("The answer is 42.\nObservation:" if include else "The answer is 42.")
    # A partial stop string is never emitted before the match decides.
    assert not any("\n" in out for out in outputs[:-1])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_one_character_at_a_time(include):
    emitted, matched, outputs = run(StopStringMatcher(["STOP"], include), list("go STOP go"))
    assert matched and emitted == ("go STOP" if include else "go ")
    assert outputs == ["g", "o", " ", "", "", "", "STOP" if include else ""]


def test_prefix_stop_strings_first_to_complete_wins():
    # "ab" completes before "abc" could, whatever the deltas.
    for deltas in (["xabc"], ["xa", "bc"], list("xabc")):
        assert run(StopStringMatcher(["abc", "ab"]), deltas)[:2] == ("x", True)
        assert run(StopStringMatcher(["abc", "ab"], True), deltas)[:2] == ("xab", True)
    # Both end at the same place: the longer one cuts earlier.
    assert run(StopStringMatcher(["b", "ab"]), ["xab"])[:2] == ("x", True)
    # A longer stop string that starts earlier but completes later loses.
    assert run(StopStringMatcher(["xabc", "b"]), ["xa", "bc"])[:2] == ("xa", True)


def test_hold_back_released_by_flush():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("result </ans") == ("result ", False)
    assert matcher.feed("wer") == ("", False)
    assert matcher.flush() == "</answer"
    assert matcher.flush() == ""


def test_false_start_is_released_once_it_cannot_match():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("OOP") == ("STOOP", False)


def test_overlapping_partial_matches():
    # "aab" must be caught even though the held tail "aa" fails as "aa?" first.
    assert run(StopStringMatcher(["aab"]), ["a", "a", "a", "b", "c"])[:2] == ("a", True)


def test_after_a_match_everything_is_dropped():
    matcher = StopStringMatcher(["."])
    assert matcher.feed("one. two") == ("one", True)
    assert matcher.stopped and matcher.matched_stop == "."
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stop_strings_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_unicode_stop_string():
    assert run(StopStringMatcher(["世界"]), ["你好世", "界!"])[:2] == ("你好", True)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stop=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    include=st.booleans(),
)
def test_emitted_text_is_always_a_prefix_of_the_reference(text, stop, cuts, include):
    expected, expected_match = reference(text, stop, include)
    matcher = StopStringMatcher(stop, include)
    emitted, matched = "", False
    for delta in split_at(text, [c for c in cuts if c <= len(text)]):
        out, matched = matcher.feed(delta)
        emitted += out
        assert expected.startswith(emitted)
        if matched:
            break
    if not matched:
        emitted += matcher.flush()
    assert (emitted, matched) == (expected, expected_match)
