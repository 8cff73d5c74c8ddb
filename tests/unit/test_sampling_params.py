"""SamplingParams: vLLM's defaults, and a ValueError naming the field for every bad value."""
from __future__ import annotations

import pytest

from pagedserve.sampling_params import MAX_STOP_STRINGS, SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens, p.min_tokens) == (1.0, 1.0, 0, 0.0, None, 16, 0)
    assert p.stop_token_ids == [] and p.ignore_eos is False and p.logprobs is None
    assert p.stop == [] and p.include_stop_str_in_output is False and p.skip_special_tokens is True
    assert SamplingParams(temperature=0).greedy and not p.greedy
    # Below vLLM's epsilon a temperature means greedy: dividing by it would overflow the logits.
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.5),
    ("seed", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("ignore_eos", 1), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", 1.0),
    ("stop", "STOP"), ("stop", [""]), ("stop", ["ok", 3]), ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
    ("include_stop_str_in_output", 1), ("skip_special_tokens", "yes"),
    # Wider than the field on the wire (int32; the seed int64).
    ("top_k", 1 << 31), ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("stop_token_ids", [1 << 31]),
    ("logit_bias", {"\u00b2": 1.0}), ("logit_bias", {"\u0661\u0662": 1.0}),  # digits, not ASCII ones
    ("regex", ""), ("regex", 5), ("choice", []), ("choice", ["a", ""]), ("choice", "ab"), ("choice", ["a"] * 257),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", ["a"]), ("allowed_token_ids", 5),
    ("allowed_token_ids", [1 << 31]), ("allowed_token_ids", [1] * ((1 << 18) + 1)), ("bad_words", "word"), ("bad_words", [" "]), ("bad_words", [3]),
    ("bad_words", ["w"] * 65), ("bad_words", ["w" * 257]), ("bad_words_token_ids", [[]]),
    ("bad_words_token_ids", [[-1]]), ("bad_words_token_ids", [1, 2]),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", 1.5),
    ("grammar", " "), ("grammar", 5),
])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_allowed_tokens_that_could_never_be_sampled_are_refused():
    # Structured output decides the tokens itself; together the two could leave none.
    with pytest.raises(ValueError, match="^allowed_token_ids and regex are exclusive"):
        SamplingParams(allowed_token_ids=[1], regex="a+")
    with pytest.raises(ValueError, match="^allowed_token_ids must be below the vocabulary size"):
        SamplingParams(allowed_token_ids=[1, 100]).check_token_ids(100)
    with pytest.raises(ValueError, match="^bad_words tokenize to ids beyond"):
        SamplingParams(bad_words_token_ids=[[5, 100]]).check_token_ids(100)
    # All banned from the first token on: by one-token bad words, or as stop tokens (EOS among them) before
    # min_tokens; a two-token bad word bans only after its first token, and ignore_eos keeps EOS allowed.
    for params, eos in ((SamplingParams(allowed_token_ids=[1, 2], bad_words_token_ids=[[1], [2]]), ()),
                        (SamplingParams(allowed_token_ids=[1, 2], stop_token_ids=[1], min_tokens=2), (2,))):
        with pytest.raises(ValueError, match="^allowed_token_ids are all banned"):
            params.check_allowed_tokens(eos)
    SamplingParams(allowed_token_ids=[1, 2], bad_words_token_ids=[[1], [3, 2]]).check_allowed_tokens()
    SamplingParams(allowed_token_ids=[1, 2], stop_token_ids=[1], min_tokens=2, ignore_eos=True).check_allowed_tokens((2,))
    SamplingParams(allowed_token_ids=[1, 2], stop_token_ids=[1, 2]).check_allowed_tokens()  # no min_tokens


class WordTokenizer:
    """Each space-separated word one token; a word after a space another one, unless listed as the same."""

    def __init__(self, same_spaced: set[str]) -> None:
        self.same_spaced, self.ids = same_spaced, {}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert not add_special_tokens
        words = text.split(" ")
        keys = [w if i == 0 or w in self.same_spaced else " " + w for i, w in enumerate(words) if w or i]
        return [self.ids.setdefault(k, len(self.ids)) for k in keys if k.strip()]


def test_bad_words_tokenize_alone_and_after_a_space_as_vllms_do():
    tokenizer = WordTokenizer(same_spaced={"x"})
    params = SamplingParams(bad_words=["  hello world", "x"])
    params.tokenize_bad_words(tokenizer)
    hello, world, spaced_hello, x = (tokenizer.ids[k] for k in ("hello", " world", " hello", "x"))
    # The leading spaces dropped; " hello world" is another sequence as long; " x" is the same token as "x".
    assert params.bad_words_token_ids == [[hello, world], [spaced_hello, world], [x]]
    assert params.needs_token_history and not SamplingParams(bad_words=["w"]).needs_token_history


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens():
    prompt = list(range(100, 120))
    assert SamplingParams().truncated(prompt, 64) is prompt
    assert SamplingParams(truncate_prompt_tokens=5).truncated(prompt, 64) == prompt[-5:]
    assert SamplingParams(truncate_prompt_tokens=50).truncated(prompt, 64) == prompt
    # -1: whatever leaves room for max_tokens in the context (one token without max_tokens).
    assert SamplingParams(truncate_prompt_tokens=-1, max_tokens=4).truncated(prompt, 16) == prompt[-12:]
    assert SamplingParams(truncate_prompt_tokens=-1, max_tokens=None).truncated(prompt, 16) == prompt[-15:]


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5


def test_stop_strings_up_to_the_bound_are_kept_as_a_list():
    stop = tuple(f"s{i}" for i in range(MAX_STOP_STRINGS))
    assert SamplingParams(stop=stop).stop == list(stop)


def test_each_choice_runs_alone_seeded_apart_and_only_the_first_asks_for_the_prompts_logprobs():
    params = SamplingParams(n=3, seed=(1 << 63) - 2, prompt_logprobs=2, temperature=0.7)
    choices = [params.for_choice(i) for i in range(3)]
    assert [c.n for c in choices] == [1, 1, 1]
    assert [c.seed for c in choices] == [(1 << 63) - 2, (1 << 63) - 1, 0]  # int64 on the wire: wraps
    assert [c.prompt_logprobs for c in choices] == [2, None, None]
    assert all(c.temperature == 0.7 for c in choices)
    assert SamplingParams(n=2).for_choice(1).seed is None


def test_one_structure_per_request_and_its_grammar():
    with pytest.raises(ValueError, match="^regex and choice are exclusive"):
        SamplingParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="^json_schema and json_object are exclusive"):
        SamplingParams(json_schema="{}", json_object=True)
    assert not SamplingParams().structured
    assert SamplingParams(regex="[0-9]+").grammar_source() == ("regex", "[0-9]+")
    assert SamplingParams(json_object=True).grammar_source() == ("json_object", "")
    assert SamplingParams(json_schema='{"type": "string"}').grammar_source() == ("json_schema", '{"type": "string"}')
    # Each choice one string literal, its quotes and backslashes escaped.
    choice = SamplingParams(choice=["yes", 'say "no"', "a\\b"])
    assert choice.structured and choice.needs_token_history
    assert choice.grammar_source() == ("ebnf", 'root ::= "yes" | "say \\"no\\"" | "a\\\\b"')
    grammar = SamplingParams(grammar='root ::= "a" root | "b"')
    assert grammar.structured and grammar.grammar_source() == ("ebnf", 'root ::= "a" root | "b"')
    with pytest.raises(ValueError, match="^regex and grammar are exclusive"):
        SamplingParams(regex="a+", grammar='root ::= "a"')
