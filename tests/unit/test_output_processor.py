"""RequestOutputState with the SmolLM2 tokenizer: text deltas, stop strings, finish reasons and usage."""
from __future__ import annotations

import pytest

from pagedserve.output import OutputDelta, RequestOutputState, Usage
from pagedserve.sampling_params import SamplingParams

TEXT = "The answer is 42, café.\nObservation: done, and more after it."
STOP = "\nObservation:"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


@pytest.fixture(scope="module")
def prompt_ids(tok) -> list[int]:
    return tok.encode("Tell me the answer.", add_special_tokens=False)


def feed(state: RequestOutputState, ids: list[int], last_reason: str | None = "length") -> list[OutputDelta]:
    """One token per step, the scheduler ending the request on the last; stops at the first finished delta."""
    deltas = []
    for i, token_id in enumerate(ids):
        deltas.append(state.update([token_id], last_reason if i == len(ids) - 1 else None))
        if deltas[-1].finished:
            break
    return deltas


def completing_index(tok, ids: list[int], stop: str) -> int:
    """The index of the first token whose text completes ``stop``."""
    return next(k for k in range(len(ids)) if stop in tok.decode(ids[:k + 1]))


def test_deltas_add_up_to_the_text_and_the_last_one_reports_usage(tok, prompt_ids):
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas = feed(RequestOutputState(tok, prompt_ids, SamplingParams()), ids)
    assert "".join(d.text for d in deltas) == TEXT
    assert len(deltas) == len(ids)
    assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
    assert (deltas[-1].finish_reason, deltas[-1].usage, deltas[-1].abort) == (
        "length", Usage(len(prompt_ids), len(ids)), False
    )


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_over_several_tokens_ends_at_the_token_that_completes_it(tok, prompt_ids, include):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(tok.encode(STOP, add_special_tokens=False)) > 1
    params = SamplingParams(stop=["never seen", STOP], include_stop_str_in_output=include)
    deltas = feed(RequestOutputState(tok, prompt_ids, params), ids)
    end = TEXT.index(STOP) + (len(STOP) if include else 0)
    assert "".join(d.text for d in deltas) == TEXT[:end]
    k = completing_index(tok, ids, STOP)
    assert len(deltas) == k + 1 < len(ids)
    last = deltas[-1]
    assert (last.finish_reason, last.abort, last.usage) == ("stop", True, Usage(len(prompt_ids), k + 1))


@pytest.mark.parametrize("include", [False, True])
def test_tokens_of_several_steps_at_once_end_at_the_token_that_completes_a_stop_string(tok, prompt_ids, include):
    """A reader that fell behind gets several steps' tokens joined: the request ends where it would have
    step by step, and the tokens after the one that completed the stop string are not output."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=[STOP], include_stop_str_in_output=include)
    k = completing_index(tok, ids, STOP)
    step_by_step = feed(RequestOutputState(tok, prompt_ids, params), ids)
    state = RequestOutputState(tok, prompt_ids, params)
    first = state.update(ids[:k - 1])  # before the stop string is complete: all of them count
    joined = state.update(ids[k - 1:k + 3])  # completes it with its second token; two more came with it
    assert first.num_tokens is None and not first.finished
    assert (joined.num_tokens, joined.finish_reason, joined.abort) == (2, "stop", True)
    assert first.text + joined.text == "".join(d.text for d in step_by_step)
    assert joined.usage == step_by_step[-1].usage == Usage(len(prompt_ids), k + 1)


def test_stop_string_completed_by_the_last_token_wins_over_length(tok, prompt_ids):
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop = "after it."
    assert TEXT.endswith(stop) and TEXT.index(stop) == len(TEXT) - len(stop)
    deltas = feed(RequestOutputState(tok, prompt_ids, SamplingParams(stop=[stop])), ids, "length")
    assert len(deltas) == len(ids)
    assert "".join(d.text for d in deltas) == TEXT[:-len(stop)]
    assert (deltas[-1].finish_reason, deltas[-1].abort) == ("stop", True)


def test_unmatched_stop_prefix_is_held_back_then_released_at_the_end(tok, prompt_ids):
    text = TEXT[:TEXT.index(STOP) + 4]  # ends with "\nObs", the start of the stop string
    ids = tok.encode(text, add_special_tokens=False)
    deltas = feed(RequestOutputState(tok, prompt_ids, SamplingParams(stop=[STOP])), ids, "length")
    assert not "".join(d.text for d in deltas[:-1]).endswith("\nObs")
    assert "".join(d.text for d in deltas) == text
    assert (deltas[-1].finish_reason, deltas[-1].abort) == ("length", False)


def test_stop_string_in_the_prompt_is_not_matched(tok):
    prompt = tok.encode("Reply, then write" + STOP, add_special_tokens=False)
    ids = tok.encode(" fine", add_special_tokens=False)
    deltas = feed(RequestOutputState(tok, prompt, SamplingParams(stop=[STOP])), ids)
    assert "".join(d.text for d in deltas) == " fine"
    assert deltas[-1].finish_reason == "length"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, prompt_ids, skip):
    special = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hi", add_special_tokens=False) + [special] + tok.encode(" there", add_special_tokens=False)
    deltas = feed(RequestOutputState(tok, prompt_ids, SamplingParams(skip_special_tokens=skip)), ids)
    assert "".join(d.text for d in deltas) == ("Hi there" if skip else "Hi<|im_end|> there")


@pytest.mark.parametrize("include", [False, True])
def test_the_token_that_stopped_the_request_shows_its_text_only_when_asked(tok, prompt_ids, include):
    """As vLLM: EOS or a stop token id ends the request counted (usage, token ids) but, unless
    include_stop_str_in_output, without its text, whether or not it is a special token."""
    for stop_token in (tok.convert_tokens_to_ids("<|im_end|>"), tok.encode(",", add_special_tokens=False)[0]):
        ids = tok.encode("Hi", add_special_tokens=False) + [stop_token]
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        deltas = feed(RequestOutputState(tok, prompt_ids, params), ids, "stop")
        assert "".join(d.text for d in deltas) == tok.decode(ids if include else ids[:-1])
        assert deltas[-1].usage.completion_tokens == len(ids)


def test_stop_strings_count_from_the_token_after_min_tokens(tok, prompt_ids):
    """As vLLM: the text of the first min_tokens tokens is never cut at a stop string."""
    ids = tok.encode("Hi, Hi, Hi, Hi", add_special_tokens=False)
    first_comma = tok.decode(ids).index(",")
    deltas = feed(RequestOutputState(tok, prompt_ids, SamplingParams(stop=[","])), ids)
    assert "".join(d.text for d in deltas) == "Hi" and deltas[-1].finish_reason == "stop" and first_comma == 2
    deltas = feed(RequestOutputState(tok, prompt_ids, SamplingParams(stop=[","], min_tokens=3)), ids)
    text = "".join(d.text for d in deltas)
    assert text == tok.decode(ids[:3]) + tok.decode(ids)[len(tok.decode(ids[:3])):].split(",")[0]
    assert deltas[-1].finish_reason == "stop" and len(deltas) > 3


def test_without_a_tokenizer_tokens_are_counted_and_stop_strings_refused():
    with pytest.raises(ValueError, match="tokenizer"):
        RequestOutputState(None, [1, 2], SamplingParams(stop=["x"]))
    deltas = feed(RequestOutputState(None, [1, 2], SamplingParams()), [5, 6, 7])
    assert [d.text for d in deltas] == ["", "", ""]
    assert (deltas[-1].finish_reason, deltas[-1].usage) == ("length", Usage(2, 3))
