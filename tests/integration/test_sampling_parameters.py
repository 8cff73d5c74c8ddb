"""Every sampling parameter of the public APIs, on both: the official openai client against the HTTP API and
pagedserve.client against the gRPC API, on one running stack for the module (tests/integration/conftest.py).

PARAMETERS is the table. Each entry checks what its parameter does through an Api: an adapter that takes
vLLM's parameter names and puts them on its API's wire (HttpApi: OpenAI's fields, vLLM's extensions in the
body, X-Request-Id as a header, chat for messages; GrpcApi: the SamplingParams fields). The checks compare
with transformers' float32 reference (greedy text, logprobs, and penalties, bias and min_tokens re-applied to
its logits), or hold every sampled token against the model's own top logprobs that come back with it (and
show that sampling without the filter breaks the rule the filter keeps). docs/openai_api.md lists the test
of each parameter on each API.
"""
from __future__ import annotations

import functools
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import jsonschema
import pytest
import torch

from pagedserve.client import build_request
from pagedserve.convert import FINISH_REASON_NAMES
from tests.integration.conftest import MODEL
from tests.support.tiny_stack import kv_stats

PROMPT = "The three primary colors are"
STORY = "Once upon a time, in a village by the sea,"
REPEAT = "List of fruits: apple, banana,"  # greedy repeats itself: each penalty changes it
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
JSON_CHAT = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


# ------------------------------------------------------------------------------------------ the two APIs

@dataclass
class Token:
    text: str
    logprob: float | None
    top: dict[str, float]  # the top logprobs that came with it, by token text


@dataclass
class Choice:
    text: str
    finish_reason: str
    tokens: list[Token] | None  # with logprobs


@dataclass
class Result:
    choices: list[Choice]  # by index
    completion_tokens: int  # of every choice together
    request_id: str
    prompt: list[Token] | None = None  # the prompt's tokens and logprobs (echo, prompt_logprobs)
    echo: str | None = None  # the prompt's text, echoed

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @property
    def tokens(self) -> list[Token]:
        return self.choices[0].tokens


class Api:
    """What both adapters share: one unfiltered sampled output, with the model's top-20 logprobs of each token."""

    FREE_SAMPLE = dict(temperature=1.0, seed=1, max_tokens=32, ignore_eos=True, logprobs=20)
    _free: list[Token] | None = None

    def sampled_freely(self) -> list[Token]:
        if self._free is None:
            self._free = self.complete(STORY, **self.FREE_SAMPLE).tokens
        return self._free


class HttpApi(Api):
    name = "http"
    echoes_text = True
    OPENAI_FIELDS = {"temperature", "top_p", "seed", "n", "stop", "max_tokens", "presence_penalty",
                     "frequency_penalty", "logit_bias"}
    # (the gRPC API's names on the left)
    VLLM_NAMES = {"regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}

    def __init__(self, client, stack) -> None:
        self.client, self.stack = client, stack

    def complete(self, prompt: str | None = None, messages: list[dict] | None = None, *, logprobs: int | None = None,
                 echo: bool = False, request_id: str | None = None, json_schema: dict | None = None,
                 json_object: bool = False, **params) -> Result:
        kwargs = {name: value for name, value in params.items() if name in self.OPENAI_FIELDS}
        extra = {self.VLLM_NAMES.get(name, name): value for name, value in params.items()
                 if name not in self.OPENAI_FIELDS}
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = {str(token): bias for token, bias in kwargs["logit_bias"].items()}
        response_format = ({"type": "json_schema", "json_schema": {"name": "output", "schema": json_schema}}
                           if json_schema is not None else {"type": "json_object"} if json_object else None)
        headers = {"X-Request-Id": request_id} if request_id else {}
        if messages is not None:
            if logprobs is not None:
                kwargs.update(logprobs=True, top_logprobs=logprobs)
            if response_format is not None:
                kwargs["response_format"] = response_format
            raw = self.client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, extra_body=extra, extra_headers=headers, **kwargs)
            body = raw.parse()
            choices = [Choice(c.message.content, c.finish_reason,
                              [Token(t.token, t.logprob, {e.token: e.logprob for e in t.top_logprobs})
                               for t in c.logprobs.content] if c.logprobs else None)
                       for c in sorted(body.choices, key=lambda c: c.index)]
            return Result(choices, body.usage.completion_tokens, raw.headers["x-request-id"])
        if response_format is not None:
            extra["response_format"] = response_format
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        raw = self.client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, echo=echo, extra_body=extra, extra_headers=headers, **kwargs)
        body = raw.parse()
        assert body.id == f"cmpl-{raw.headers['x-request-id']}"
        result = Result([], body.usage.completion_tokens, raw.headers["x-request-id"])
        for c in sorted(body.choices, key=lambda c: c.index):
            text, tokens = c.text, None
            if c.logprobs is not None:
                tokens = [Token(*entry[:2], entry[2] or {}) for entry in
                          zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs)]
            if echo:
                assert text.startswith(prompt)
                result.echo, text = prompt, text[len(prompt):]
                if tokens is not None:
                    result.prompt, tokens = tokens[:body.usage.prompt_tokens], tokens[body.usage.prompt_tokens:]
            result.choices.append(Choice(text, c.finish_reason, tokens))
        return result


    def prompt_logprobs(self, num: int, prompt: str | None = None, messages: list[dict] | None = None) -> list[dict]:
        """vLLM's prompt_logprobs as {token id: (logprob, rank)} per prompt position after the first."""
        if messages is not None:
            body = self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                       extra_body={"prompt_logprobs": num}).model_extra
        else:
            body = self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                                  extra_body={"prompt_logprobs": num}).choices[0].model_extra
        first, *rest = body["prompt_logprobs"]
        assert first is None
        return [{int(i): (e["logprob"], e["rank"]) for i, e in entry.items()} for entry in rest]


class GrpcApi(Api):
    name = "grpc"
    echoes_text = False  # the caller has its prompt: prompt_logprobs gives what echo's logprobs give

    def __init__(self, client, tokenizer, stack) -> None:
        self.client, self.tokenizer, self.stack = client, tokenizer, stack

    def _token(self, entry) -> Token:
        return Token(self.tokenizer.decode([entry.token_id]), entry.logprob,
                     {self.tokenizer.decode([i]): lp for i, lp in zip(entry.top_token_ids, entry.top_logprobs)})

    def complete(self, prompt: str | None = None, messages: list[dict] | None = None, *, logprobs: int | None = None,
                 echo: bool = False, request_id: str | None = None, json_schema: dict | None = None,
                 json_object: bool = False, cache_salt: str = "", **params) -> Result:
        if logprobs is not None:
            params["logprobs"] = logprobs
            if echo:
                params["prompt_logprobs"] = logprobs
        if json_schema is not None:
            params["json_schema"] = json.dumps(json_schema)
        request = build_request(prompt, messages=messages, request_id=request_id or "", cache_salt=cache_salt,
                                json_object=json_object or None, **params)
        texts, finish, tokens, prompt_tokens, used = {}, {}, {}, None, 0
        response_id = ""
        for response in self.client.stream(request, timeout=300):
            response_id = response.request_id
            texts[response.index] = texts.get(response.index, "") + response.text
            tokens.setdefault(response.index, []).extend(self._token(t) for t in response.logprobs)
            if response.prompt_logprobs:
                first = self.tokenizer.encode(prompt, add_special_tokens=False)[0]
                prompt_tokens = [Token(self.tokenizer.decode([first]), None, {})]
                prompt_tokens += [self._token(t) for t in response.prompt_logprobs]
            if response.finish_reason:
                finish[response.index] = FINISH_REASON_NAMES[response.finish_reason]
                used += response.usage.completion_tokens
        choices = [Choice(texts[i], finish[i], tokens[i] if logprobs is not None else None) for i in sorted(texts)]
        return Result(choices, used, response_id, prompt_tokens)

    def prompt_logprobs(self, num: int, prompt: str | None = None, messages: list[dict] | None = None) -> list[dict]:
        request = build_request(prompt, messages=messages, max_tokens=1, prompt_logprobs=num)
        entries = next(r.prompt_logprobs for r in self.client.stream(request, timeout=300) if r.prompt_logprobs)
        return [{e.token_id: (e.logprob, e.rank),
                 **{i: (lp, rank) for rank, (i, lp) in enumerate(zip(e.top_token_ids, e.top_logprobs), start=1)}}
                for e in entries]


@pytest.fixture(scope="module", params=["http", "grpc"])
def api(request, api_stack, openai_client, grpc_client, tokenizer):
    return HttpApi(openai_client, api_stack) if request.param == "http" else GrpcApi(grpc_client, tokenizer, api_stack)


# ------------------------------------------------------------------------------------------ the reference

class Reference:
    """The default model in transformers, float32, and its tokenizer, with the server's output rules."""

    def __init__(self, model, tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, eos_token_ids

    def ids(self, prompt: str | None = None, messages: list[dict] | None = None, **chat_options) -> tuple[int, ...]:
        if messages is not None:
            chat_options.setdefault("add_generation_prompt", True)
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, **chat_options)
        return tuple(self.tokenizer.encode(prompt, add_special_tokens=False))

    def text(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @functools.cache
    def log_softmax(self, token_ids: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)

    @functools.cache
    def greedy(self, prompt_ids: tuple[int, ...], max_tokens: int, *, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, logit_bias: tuple = (),
               min_tokens: int = 0, ignore_eos: bool = False, allowed: tuple = (),
               bad_words: tuple = ()) -> tuple[int, ...]:
        """vLLM's rules on transformers' logits: only the allowed tokens (if any), bias, then repetition over
        prompt and output, frequency and presence over the output; end-of-sequence banned before min_tokens,
        and ending the output unless ignore_eos; a bad word's (token sequence's) last token banned where the
        output ends in the rest of it."""
        out: list[int] = []
        with torch.no_grad():
            step = self.model(torch.tensor([prompt_ids]), use_cache=True)
            for _ in range(max_tokens):
                logits = step.logits[0, -1].float().clone()
                if allowed:
                    keep = logits[list(allowed)].clone()
                    logits[:] = -math.inf
                    logits[list(allowed)] = keep
                for sequence in bad_words:
                    if len(sequence) == 1 or tuple(out[len(out) - len(sequence) + 1:]) == sequence[:-1]:
                        logits[sequence[-1]] = -math.inf
                for token, bias in logit_bias:
                    logits[token] += bias
                for token in set(prompt_ids) | set(out):
                    logits[token] = logits[token] / repetition_penalty if logits[token] > 0 \
                        else logits[token] * repetition_penalty
                for token, count in Counter(out).items():
                    logits[token] -= frequency_penalty * count + presence_penalty
                if len(out) < min_tokens:
                    logits[list(self.eos_token_ids)] = -math.inf
                token = int(logits.argmax())
                out.append(token)
                if token in self.eos_token_ids and not ignore_eos:
                    break
                step = self.model(torch.tensor([[token]]), cache=step.cache, use_cache=True)
        return tuple(out)


@pytest.fixture(scope="module")
def ref(hf_model, tokenizer):
    from executor_svc.model_loader import generation_eos_token_ids, resolve_model_dir

    eos = {hf_model.config.eos_token_id} | set(generation_eos_token_ids(resolve_model_dir("default")))
    return Reference(hf_model, tokenizer, tuple(sorted(eos)))


# ------------------------------------------------------------------------------------------ the checks

def rank(token: Token) -> int:
    """How many of the listed tokens are more likely than the chosen one."""
    return sum(lp > token.logprob + 1e-6 for lp in token.top.values())


def mass_above(token: Token) -> float:
    """The probability of the listed tokens more likely than the chosen one."""
    return sum(math.exp(lp) for lp in token.top.values() if lp > token.logprob)


def check_filter(api, ref, kept: Callable[[Token], bool], **params) -> None:
    """Sampled with the filter (params), every token keeps the rule; sampled without it, some token breaks it:
    so the rule is the filter's doing. The filter at its tightest leaves the greedy choice alone."""
    greedy = ref.text(ref.greedy(ref.ids(PROMPT), 8))
    tightest = {"top_p": 1e-9, "top_k": 1, "min_p": 1.0}
    assert api.complete(PROMPT, temperature=1.0, seed=1, max_tokens=8,
                        **{name: tightest[name] for name in params}).text == greedy
    filtered = api.complete(STORY, **{**Api.FREE_SAMPLE, "max_tokens": 16}, **params).tokens
    assert all(kept(t) for t in filtered), [(t.text, t.logprob) for t in filtered if not kept(t)]
    assert not all(kept(t) for t in api.sampled_freely()), "sampling without the filter keeps the rule too"


def check_temperature(api, ref):
    expected = ref.text(ref.greedy(ref.ids(PROMPT), 8))
    assert api.complete(PROMPT, temperature=0, max_tokens=8).text == expected
    assert api.complete(PROMPT, temperature=1e-6, max_tokens=8).text == expected  # below vLLM's epsilon: greedy
    sampled = {api.complete(STORY, temperature=1.5, seed=seed, max_tokens=8).text for seed in range(2)}
    assert len(sampled) > 1


def check_top_p(api, ref):
    check_filter(api, ref, lambda t: mass_above(t) < 0.5 + 1e-4, top_p=0.5)


def check_top_k(api, ref):
    check_filter(api, ref, lambda t: rank(t) < 3, top_k=3)


def check_min_p(api, ref):
    check_filter(api, ref, lambda t: t.logprob >= max(t.top.values()) + math.log(0.2) - 1e-4, min_p=0.2)


def check_seed(api, ref):
    first = api.complete(STORY, temperature=1.0, seed=7, max_tokens=8)
    assert api.complete(STORY, temperature=1.0, seed=7, max_tokens=8).text == first.text
    assert api.complete(STORY, temperature=1.0, seed=8, max_tokens=8).text != first.text


def check_n(api, ref):
    prompt = "Write one sentence about the sea. " * 6  # several full KV blocks
    hits = kv_stats(api.stack).prefix_cache_hits
    # A prefix-cache namespace of its own: no earlier hits.
    params = dict(n=3, seed=5, temperature=1.0, max_tokens=6, ignore_eos=True, cache_salt=f"n-{api.name}")
    result = api.complete(prompt, **params)
    texts = [c.text for c in result.choices]
    assert len(texts) == 3 and len(set(texts)) > 1 and result.completion_tokens == 18
    # The siblings were admitted on the first choice's blocks: every full block but the one holding the last
    # prompt token (always computed) was a hit, twice.
    assert kv_stats(api.stack).prefix_cache_hits - hits == 2 * ((len(ref.ids(prompt)) - 1) // 16 * 16) > 0
    assert [c.text for c in api.complete(prompt, **params).choices] == texts
    # Choice i is the request it would be alone, seeded seed + i.
    assert api.complete(prompt, **{**params, "n": 1, "seed": 7}).text == texts[2]


def check_stop(api, ref):
    full = ref.text(ref.greedy(ref.ids(PROMPT), 16))
    stop = full[len(full) // 2: len(full) // 2 + 3]
    result = api.complete(PROMPT, temperature=0, max_tokens=16, stop=[stop])
    assert result.text == full[: full.index(stop)] and result.finish_reason == "stop"


def check_stop_token_ids(api, ref):
    ids = ref.greedy(ref.ids(PROMPT), 16)
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    result = api.complete(PROMPT, temperature=0, max_tokens=16, stop_token_ids=[ids[at]])
    assert result.completion_tokens == at + 1 and result.finish_reason == "stop"
    assert result.text == ref.text(ids[:at])  # the stop token counts, without its text (vLLM's way)


def check_max_tokens(api, ref):
    result = api.complete(PROMPT, temperature=0, max_tokens=5)
    assert result.completion_tokens == 5 and result.finish_reason == "length"
    assert result.text == ref.text(ref.greedy(ref.ids(PROMPT), 5))


def check_min_tokens(api, ref):
    prompt = ref.ids(messages=CHAT)
    short = ref.greedy(prompt, 48)
    assert short[-1] in ref.eos_token_ids and len(short) < 30, "the answer ends with end-of-sequence"
    min_tokens = len(short) + 4
    result = api.complete(messages=CHAT, temperature=0, max_tokens=48, min_tokens=min_tokens)
    assert result.completion_tokens >= min_tokens
    assert result.text == ref.text(ref.greedy(prompt, 48, min_tokens=min_tokens))
    assert result.text.startswith(ref.text(short)) and result.text != ref.text(short)


def check_ignore_eos(api, ref):
    prompt = ref.ids(messages=CHAT)
    short = ref.greedy(prompt, 48)
    plain = api.complete(messages=CHAT, temperature=0, max_tokens=len(short) + 8)
    assert plain.finish_reason == "stop" and plain.completion_tokens == len(short)
    result = api.complete(messages=CHAT, temperature=0, max_tokens=len(short) + 8, ignore_eos=True)
    assert result.finish_reason == "length" and result.completion_tokens == len(short) + 8
    assert result.text == ref.text(ref.greedy(prompt, len(short) + 8, ignore_eos=True))


def check_penalty(name: str, value: float):
    def check(api, ref):
        prompt = ref.ids(REPEAT)
        expected = ref.greedy(prompt, 16, ignore_eos=True, **{name: value})
        assert expected != ref.greedy(prompt, 16, ignore_eos=True), "the penalty must change the greedy output"
        assert api.complete(REPEAT, temperature=0, max_tokens=16, ignore_eos=True, **{name: value}).text == \
            ref.text(expected)
    return check


def check_logit_bias(api, ref):
    forced = ref.tokenizer.encode(" banana")[0]
    assert api.complete(PROMPT, temperature=0, max_tokens=4, logit_bias={forced: 100}).text == " banana" * 4
    banned = ref.greedy(ref.ids(PROMPT), 1)[0]
    result = api.complete(PROMPT, temperature=0, max_tokens=8, logit_bias={banned: -100})
    assert result.text == ref.text(ref.greedy(ref.ids(PROMPT), 8, logit_bias=((banned, -100),)))


def check_logprobs(api, ref):
    for inputs, num in ((dict(prompt=PROMPT), 3), (dict(messages=CHAT), 2)):  # completions, chat's top_logprobs
        prompt = ref.ids(inputs.get("prompt"), inputs.get("messages"))
        ids = ref.greedy(prompt, 6)
        expected = ref.log_softmax(prompt + ids)
        result = api.complete(**inputs, temperature=0, max_tokens=6, logprobs=num)
        assert [t.text for t in result.tokens] == [ref.tokenizer.decode([i]) for i in ids]
        for i, (token, token_id) in enumerate(zip(result.tokens, ids)):
            row = expected[len(prompt) - 1 + i]
            assert token.logprob == pytest.approx(row[token_id].item(), abs=1e-3)
            assert sorted(token.top.values(), reverse=True) == pytest.approx(row.topk(num).values.tolist(), abs=1e-3)
            assert max(token.top.values()) == pytest.approx(token.logprob)  # greedy picks the top token


def check_echo(api, ref):
    prompt = ref.ids(PROMPT)
    expected = ref.log_softmax(prompt)
    result = api.complete(PROMPT, temperature=0, max_tokens=4, echo=True, logprobs=2)
    assert result.text == ref.text(ref.greedy(prompt, 4))
    assert [t.text for t in result.prompt] == [ref.tokenizer.decode([i]) for i in prompt]
    assert result.prompt[0].logprob is None  # the first token has nothing before it
    for position, token in enumerate(result.prompt[1:], start=1):
        row = expected[position - 1]
        assert token.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-3)
        assert sorted(token.top.values(), reverse=True) == pytest.approx(row.topk(2).values.tolist(), abs=1e-3)
    if api.echoes_text:
        assert result.echo == PROMPT
        assert api.complete(PROMPT, temperature=0, max_tokens=4, echo=True).echo == PROMPT


def check_allowed_token_ids(api, ref):
    prompt = ref.ids(PROMPT)
    greedy = ref.greedy(prompt, 8)
    allowed = sorted(set(greedy[1:]) - {greedy[0]})  # the greedy output's tokens but its first
    expected = ref.greedy(prompt, 8, allowed=tuple(allowed))
    assert expected != greedy
    assert api.complete(PROMPT, temperature=0, max_tokens=8, allowed_token_ids=allowed).text == ref.text(expected)
    texts = {ref.tokenizer.decode([token]) for token in allowed}
    sampled = api.complete(STORY, **{**Api.FREE_SAMPLE, "max_tokens": 16}, allowed_token_ids=allowed).tokens
    assert all(t.text in texts for t in sampled), [t.text for t in sampled]
    # The logprobs stay the model's own (vLLM's raw logprobs): the top ones are not all allowed tokens.
    assert not all(set(t.top) <= texts for t in sampled)


def check_bad_words(api, ref):
    prompt = ref.ids(PROMPT)
    greedy = ref.greedy(prompt, 12)

    def sequences(word: str) -> tuple:  # vLLM's: the word alone, and after a space if that is as long
        alone = tuple(ref.tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(ref.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        return (alone, spaced) if spaced[0] != alone[0] and len(spaced) == len(alone) else (alone,)

    # A two-token word of the greedy output: its first token stays, its second is banned right after it.
    at = next(i for i in range(1, len(greedy) - 1)
              if greedy[i:i + 2] in sequences(ref.text(greedy[i:i + 2])) and greedy[i] not in greedy[:i])
    word = ref.text(greedy[at:at + 2])
    expected = ref.greedy(prompt, 12, bad_words=sequences(word))
    assert expected[:at + 1] == greedy[:at + 1] and expected[at + 1] != greedy[at + 1]
    assert api.complete(PROMPT, temperature=0, max_tokens=12, bad_words=[word]).text == ref.text(expected)
    # A one-token word is banned from the start, with and without its space.
    first = ref.text(greedy[:1]).strip()
    expected = ref.greedy(prompt, 12, bad_words=sequences(first))
    result = api.complete(PROMPT, temperature=0, max_tokens=12, bad_words=[first])
    assert result.text == ref.text(expected) and expected != greedy


def check_truncate_prompt_tokens(api, ref):
    prompt = STORY + " " + PROMPT
    kept = ref.ids(prompt)[-6:]
    expected = ref.text(ref.greedy(kept, 8))
    assert expected != ref.text(ref.greedy(ref.ids(prompt), 8)), "the cut must change the answer"
    result = api.complete(prompt, temperature=0, max_tokens=8, truncate_prompt_tokens=6)
    assert result.text == expected
    if api.echoes_text:  # the prompt echoed as the model saw it, and counted so
        body = api.client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1, echo=True,
                                             extra_body={"truncate_prompt_tokens": 6})
        assert body.choices[0].text.startswith(ref.text(kept)) and body.usage.prompt_tokens == 6


def check_prompt_logprobs(api, ref):
    for inputs in (dict(prompt=PROMPT), dict(messages=CHAT)):
        prompt = ref.ids(inputs.get("prompt"), inputs.get("messages"))
        expected = ref.log_softmax(prompt)
        entries = api.prompt_logprobs(2, **inputs)
        assert len(entries) == len(prompt) - 1
        for position, entry in enumerate(entries, start=1):
            row = expected[position - 1]
            top = row.topk(2)
            # The prompt's token there, ranked among all tokens (1 + those more likely), and the two most likely.
            wanted = {prompt[position]: (row[prompt[position]].item(), 1 + int((row > row[prompt[position]]).sum()))}
            wanted |= {i: (lp, rank) for rank, (i, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1)}
            assert entry.keys() == wanted.keys(), position
            for token, (logprob, rank) in wanted.items():
                assert entry[token][0] == pytest.approx(logprob, abs=1e-3)
                # Far down the distribution, near ties may order differently in another float32 implementation.
                slack = 0 if rank <= 2 else max(1, rank // 100)
                assert abs(entry[token][1] - rank) <= slack, (position, token, entry[token][1], rank)


def check_request_id(api, ref):
    for _ in range(2):  # free again once the first has ended
        assert api.complete(PROMPT, max_tokens=2, request_id="table-request-1").request_id == "table-request-1"


def check_json_object(api, ref):
    # Greedy: sampled, an object without a schema's bounds can run past max_tokens inside a string.
    result = api.complete(messages=JSON_CHAT, temperature=0, max_tokens=64, json_object=True)
    assert isinstance(json.loads(result.text), dict) and result.finish_reason == "stop"
    plain = api.complete(messages=JSON_CHAT, temperature=0, max_tokens=16)
    assert not plain.text.startswith("{"), "unconstrained, the model answers otherwise: the format is the grammar's"


def check_json_schema(api, ref):
    greedy = api.complete(messages=JSON_CHAT, temperature=0, max_tokens=64, json_schema=PERSON_SCHEMA)
    jsonschema.validate(json.loads(greedy.text), PERSON_SCHEMA)
    sampled = api.complete(messages=JSON_CHAT, temperature=1.0, seed=0, max_tokens=64, json_schema=PERSON_SCHEMA)
    jsonschema.validate(json.loads(sampled.text), PERSON_SCHEMA)


PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CAPITAL_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def check_matches(api, messages: list[dict], pattern: str, max_tokens: int, **structure) -> None:
    """Greedy and sampled, the structured output matches the pattern whole and stops; unconstrained, it does not."""
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 0}):
        result = api.complete(messages=messages, max_tokens=max_tokens, **structure, **params)
        assert re.fullmatch(pattern, result.text) and result.finish_reason == "stop", result.text
    plain = api.complete(messages=messages, temperature=0, max_tokens=max_tokens)
    assert not re.fullmatch(pattern, plain.text), "unconstrained, the model answers otherwise"


def check_regex(api, ref):
    check_matches(api, JSON_CHAT, PHONE, 32, regex=PHONE)


def check_choice(api, ref):
    cities = ["London", "Paris", "Berlin"]
    greedy = api.complete(messages=CAPITAL_CHAT, temperature=0, max_tokens=16, choice=cities)
    assert greedy.text in cities and greedy.finish_reason == "stop", greedy.text
    plain = api.complete(messages=CAPITAL_CHAT, temperature=0, max_tokens=16)
    assert plain.text not in cities, "unconstrained, the model answers in a sentence"
    odd = ["a-b", 'say "hi"', "naïve"]  # quotes, and a character past ASCII, go through the grammar as they are
    sampled = [api.complete(PROMPT, temperature=1.5, seed=seed, max_tokens=16, choice=odd).text for seed in range(4)]
    assert set(sampled) <= set(odd), sampled


# Xgrammar's EBNF dialect: an answer in one shape, sampled or greedy.
ANSWER_GRAMMAR = 'root ::= "The answer is " digits ". " ("Sure." | "Maybe.")\ndigits ::= [1-9] [0-9]*'
ANSWER = r"The answer is [1-9][0-9]*\. (Sure|Maybe)\."


def check_grammar(api, ref):
    check_matches(api, CAPITAL_CHAT, ANSWER, 24, grammar=ANSWER_GRAMMAR)


def check_chat_template_options(api, ref):
    # The answer begun by the client, carried on; a conversation rendered without the assistant's turn opened.
    begun = CAPITAL_CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    texts = []
    for messages, options in ((begun, dict(add_generation_prompt=False, continue_final_message=True)),
                              (CAPITAL_CHAT, dict(add_generation_prompt=False))):
        texts.append(ref.text(ref.greedy(ref.ids(messages=messages, **options), 8)))
        assert api.complete(messages=messages, temperature=0, max_tokens=8, **options).text == texts[-1]
    closed = api.complete(messages=begun, temperature=0, max_tokens=8).text
    assert closed != texts[0], "with the assistant's message closed, the model does not carry it on"


PARAMETERS = {
    "temperature": check_temperature,
    "top_p": check_top_p,
    "top_k": check_top_k,
    "min_p": check_min_p,
    "seed": check_seed,
    "n": check_n,
    "stop": check_stop,
    "stop_token_ids": check_stop_token_ids,
    "max_tokens": check_max_tokens,
    "min_tokens": check_min_tokens,
    "ignore_eos": check_ignore_eos,
    "presence_penalty": check_penalty("presence_penalty", 1.5),
    "frequency_penalty": check_penalty("frequency_penalty", 1.0),
    "repetition_penalty": check_penalty("repetition_penalty", 1.5),
    "logit_bias": check_logit_bias,
    "allowed_token_ids": check_allowed_token_ids,
    "bad_words": check_bad_words,
    "truncate_prompt_tokens": check_truncate_prompt_tokens,
    "logprobs": check_logprobs,
    "echo": check_echo,
    "prompt_logprobs": check_prompt_logprobs,
    "X-Request-Id": check_request_id,
    "response_format-json_object": check_json_object,
    "response_format-json_schema": check_json_schema,
    "guided_regex": check_regex,
    "guided_choice": check_choice,
    "guided_grammar": check_grammar,
    "add_generation_prompt-continue_final_message": check_chat_template_options,
}


@pytest.mark.parametrize("parameter", list(PARAMETERS))
def test_parameter(parameter, api, ref):
    PARAMETERS[parameter](api, ref)
