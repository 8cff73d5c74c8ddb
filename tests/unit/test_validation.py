"""validate_and_tokenize: each bad field rejected by name; good requests tokenized as the tokenizer does."""
from __future__ import annotations

import asyncio
import copy
import math
import threading
import time

import pytest

from frontend.validation import (LONG_INPUT_CHARS, GenerateInput, ValidationError, validate_and_tokenize,
                                 validate_and_tokenize_async)
from pagedserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 64
VOCAB = 49152


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


def validate(tok, **fields):
    fields.setdefault("request_id", "req-1")
    if not {"prompt", "prompt_token_ids", "messages"} & fields.keys():
        fields["prompt"] = "Hello"
    return validate_and_tokenize(GenerateInput(**fields), tok, MAX_MODEL_LEN, VOCAB)


USER = [{"role": "user", "content": "hi"}]

BAD = [
    ("request_id", dict(request_id="")),
    ("request_id", dict(request_id="x" * 257)),
    ("prompt", dict(prompt=None, prompt_token_ids=None, messages=None)),
    ("prompt", dict(prompt="hi", prompt_token_ids=[1])),
    ("prompt", dict(prompt="hi", messages=USER)),
    ("prompt", dict(prompt="")),
    ("prompt", dict(prompt="word " * 100)),  # longer than the context
    ("prompt", dict(prompt_token_ids=[5] * MAX_MODEL_LEN)),
    ("prompt_token_ids", dict(prompt_token_ids=[])),
    ("prompt_token_ids", dict(prompt_token_ids=[1, VOCAB])),
    ("prompt_token_ids", dict(prompt_token_ids=[-1])),
    ("prompt_token_ids", dict(prompt_token_ids=[1.0])),
    ("messages", dict(messages=[])),
    ("messages", dict(messages=[{"role": "wizard", "content": "hi"}])),
    ("messages", dict(messages=[{"role": "user", "content": ["hi"]}])),
    ("messages", dict(messages=[{"content": "hi"}])),
    ("messages", dict(messages=["hi"])),
    ("tools", dict(messages=USER, tools=[{"type": "function", "function": {}}])),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=MAX_MODEL_LEN)),  # prompt + max_tokens > context
    ("min_tokens", dict(max_tokens=None, min_tokens=MAX_MODEL_LEN)),  # up to the context, which cannot hold it
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.1)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=21)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("min_tokens", dict(min_tokens=-1)),
    ("seed", dict(seed="7")),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=["s"] * 17)),
    ("stop", dict(stop="stop")),
    ("stop_token_ids", dict(stop_token_ids=[VOCAB])),
    ("stop_token_ids", dict(stop_token_ids=[-3])),
    ("ignore_eos", dict(ignore_eos=1)),
    ("skip_special_tokens", dict(skip_special_tokens="yes")),
    ("include_stop_str_in_output", dict(include_stop_str_in_output=1)),
    ("cache_salt", dict(cache_salt="")),
    ("priority", dict(priority=2**31)),
    ("priority", dict(priority="1")),
]


@pytest.mark.parametrize("field,fields", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_input_names_the_field(tok, field, fields):
    with pytest.raises(ValidationError) as info:
        validate(tok, **fields)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_plain_prompt(tok):
    ids, params = validate(tok, prompt="Hello, world!", max_tokens=8, temperature=0.0, seed=3, stop_token_ids=[2])
    assert ids == tok.encode("Hello, world!", add_special_tokens=False)
    assert params == SamplingParams(temperature=0.0, max_tokens=8, seed=3, stop_token_ids=[2])


def test_all_sampling_fields_carried_over(tok):
    _, params = validate(
        tok, max_tokens=10, min_tokens=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=11,
        stop=["\n"], stop_token_ids=[2, 0], ignore_eos=True, logprobs=5, include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    assert params == SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=11, max_tokens=10, min_tokens=2,
        stop=["\n"], stop_token_ids=[2, 0], ignore_eos=True, logprobs=5, include_stop_str_in_output=True,
        skip_special_tokens=False,
    )


def test_prompt_token_ids_pass_through(tok):
    ids, _ = validate(tok, prompt_token_ids=[0, 17, VOCAB - 1])
    assert ids == [0, 17, VOCAB - 1]


def test_chat_template_applied(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ids, _ = validate(tok, messages=messages)
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_developer_messages_go_to_the_template_as_they_are(tok):
    """OpenAI's newer clients send their instructions as role "developer"; as in vLLM, the template renders it."""
    ids, _ = validate(tok, messages=[{"role": "developer", "content": "Be brief."}] + USER)
    assert "<|im_start|>developer\nBe brief.<|im_end|>\n<|im_start|>user\nhi" in tok.decode(ids, skip_special_tokens=False)


def test_tools_and_earlier_calls_reach_the_template_from_either_api(tok):
    """gRPC's ChatMessages.tools and ChatMessage.tool_calls arrive as the HTTP API's do: a template that shows
    tools gets them, and an earlier call its arguments as an object."""
    from frontend.server import _generate_input
    from pagedserve.client import build_request

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = USER + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "content": "12 C", "tool_call_id": "c1", "name": "get_weather"}]
    inp = _generate_input(build_request(messages=messages, tools=tools, max_tokens=4))
    assert inp.tools == tools and inp.messages[1:] == messages[1:]  # as sent; the rendering parses the arguments

    showing = copy.deepcopy(tok)  # a template that renders the tools and the calls
    showing.chat_template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
                             "{% for c in m.tool_calls or [] %}[call {{ c.function.arguments.city }}]{% endfor %}"
                             "{{ m.content }}{% endfor %}")
    text = showing.decode(validate_and_tokenize(inp, showing, 1000, VOCAB)[0])
    assert text == "[tool get_weather]hi[call Oslo]12 C"


def test_context_boundaries(tok):
    ids, params = validate(tok, prompt_token_ids=[5] * (MAX_MODEL_LEN - 1), max_tokens=1)
    assert len(ids) + params.max_tokens == MAX_MODEL_LEN
    with pytest.raises(ValidationError) as info:
        validate(tok, prompt_token_ids=[5] * (MAX_MODEL_LEN - 1), max_tokens=2)
    assert info.value.field == "max_tokens"
    # max_tokens None: up to the context, left to the scheduler.
    assert validate(tok, prompt="hi", max_tokens=None)[1].max_tokens is None


def test_limits_accepted_at_the_edge(tok):
    validate(tok, request_id="r" * 256, stop=["s"] * 16, logprobs=20, top_p=1.0, min_p=1.0, top_k=-1, cache_salt="salt")


def test_special_tokens_go_on_a_prompt_not_on_rendered_messages_unless_asked():
    """As vLLM's completion and chat APIs: a BOS-adding tokenizer gets its BOS on a text prompt (a base model
    expects it), not on a chat template's text, which writes its own."""
    class BosTokenizer:
        def encode(self, text, add_special_tokens):
            return ([1] if add_special_tokens else []) + [ord(c) for c in text]

        def apply_chat_template(self, messages, **options):
            return "".join(m["content"] for m in messages)

    def ids(**fields):
        return validate_and_tokenize(GenerateInput(request_id="r", **fields), BosTokenizer(), 64, 256)[0]

    assert ids(prompt="ab") == [1, 97, 98] and ids(prompt="ab", add_special_tokens=False) == [97, 98]
    assert ids(messages=USER) == [104, 105] and ids(messages=USER, add_special_tokens=True) == [1, 104, 105]


def test_a_long_input_is_tokenized_off_the_event_loop_a_short_one_inline():
    """A long prompt's (or chat's) tokenizing runs in the tokenizing thread, so that the event loop (everyone
    else's streams, the health checks) goes on meanwhile; a short one's runs inline."""
    class SlowTokenizer:
        def __init__(self):
            self.threads = []

        def encode(self, text, add_special_tokens):
            self.threads.append(threading.current_thread())
            time.sleep(0.3 if len(text) >= LONG_INPUT_CHARS else 0)
            return [1, 2, 3]

        def apply_chat_template(self, messages, **options):
            return "".join(m["content"] for m in messages)

    async def main(tokenizer):
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        long_chat = [{"role": "user", "content": "x" * (LONG_INPUT_CHARS // 2)}] * 2
        answers = [await validate_and_tokenize_async(GenerateInput(request_id="r", **fields), tokenizer, 64, 256)
                   for fields in (dict(prompt="x" * LONG_INPUT_CHARS), dict(messages=long_chat))]
        ticks_meanwhile = ticks
        answers.append(await validate_and_tokenize_async(GenerateInput(request_id="r", prompt="x"), tokenizer, 64,
                                                         256))
        ticker.cancel()
        return answers, ticks_meanwhile

    tokenizer = SlowTokenizer()
    answers, ticks_meanwhile = asyncio.run(main(tokenizer))
    assert [ids for ids, _ in answers] == [[1, 2, 3]] * 3
    assert [t is threading.main_thread() for t in tokenizer.threads] == [False, False, True]
    assert ticks_meanwhile >= 20  # the loop ran on through the two 0.3 s tokenizations


def test_chat_template_rejection_becomes_a_messages_error():
    class StrictTokenizer:
        def apply_chat_template(self, messages, **kwargs):
            raise ValueError("Conversation roles must alternate user/assistant")

    with pytest.raises(ValidationError) as info:
        validate_and_tokenize(GenerateInput(request_id="r", messages=USER), StrictTokenizer(), 64, 256)
    assert info.value.field == "messages" and "alternate" in str(info.value)


class _MustNotTokenize:
    """A tokenizer that fails the test if it is asked for anything."""

    def __getattr__(self, name):
        raise AssertionError(f"tokenizer.{name} used for a prompt that should be refused by size")


@pytest.mark.parametrize("field,fields", [
    ("prompt", dict(prompt="x" * (10 << 20))),
    ("prompt", dict(prompt="é" * 1001)),
    ("messages", dict(messages=[{"role": "user", "content": "a" * 600}, {"role": "user", "content": "b" * 401}])),
    ("messages", dict(messages=[{"role": "user", "content": ""}] * 251)),  # the roles count: 251 x "user"
    ("prompt", dict(prompt_token_ids=[1] * (10 << 20))),
])
def test_an_oversized_prompt_is_refused_before_tokenizing(field, fields):
    with pytest.raises(ValidationError, match="characters|tokens") as info:
        validate_and_tokenize(GenerateInput(request_id="r", **fields), _MustNotTokenize(), MAX_MODEL_LEN, VOCAB,
                              max_prompt_chars=1000)
    assert info.value.field == field


def test_a_prompt_at_the_character_limit_is_tokenized(tok):
    ids, _ = validate_and_tokenize(GenerateInput(request_id="r", prompt="hi " * 10), tok, MAX_MODEL_LEN, VOCAB,
                                   max_prompt_chars=30)
    assert ids == tok.encode("hi " * 10, add_special_tokens=False)


def test_a_prompt_that_tokenizes_beyond_the_models_vocabulary_is_refused(tok):
    # The default tokenizer's ids run to 49151; a model of 160 ids cannot embed "Hello".
    with pytest.raises(ValidationError, match="beyond the model's vocabulary") as info:
        validate_and_tokenize(GenerateInput(request_id="r", prompt="Hello"), tok, MAX_MODEL_LEN, 160)
    assert info.value.field == "prompt"


@pytest.mark.parametrize("field,fields,reason", [
    ("regex", dict(regex="[a-"), "Regex parsing error at position 4"),
    ("json_schema", dict(json_schema='{"type": 5}'), "Type should be a string"),
])
def test_an_unusable_grammar_is_refused_with_xgrammars_reason_alone(tok, field, fields, reason):
    with pytest.raises(ValidationError) as info:
        validate(tok, **fields)
    assert info.value.field == field
    # Not xgrammar's time stamp and source line, which it puts before the reason.
    assert str(info.value).startswith(f"{field} is not usable: {reason}"), str(info.value)


def test_a_schema_nested_beyond_the_json_parsers_depth_is_a_bad_request(tok):
    with pytest.raises(ValidationError, match="^json_schema is nested too deeply") as info:
        validate(tok, json_schema='{"items": ' * 5000 + "{}" + "}" * 5000)
    assert info.value.field == "json_schema"


def test_chat_options_render_the_conversation_as_the_template_does(tok):
    begun = USER + [{"role": "assistant", "content": "Hello, I am"}]
    ids, _ = validate(tok, messages=begun, add_generation_prompt=False, continue_final_message=True)
    text = tok.apply_chat_template(begun, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert tok.decode(ids) == text and text.endswith("Hello, I am")
    closed, _ = validate(tok, messages=begun)
    assert tok.decode(closed).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("field,fields", [
    ("continue_final_message", dict(continue_final_message=True)),  # with add_generation_prompt left true
    ("chat_template_kwargs", dict(chat_template_kwargs={"tokenize": True})),
    ("chat_template_kwargs", dict(chat_template_kwargs={"messages": []})),
    ("chat_template_kwargs", dict(chat_template_kwargs={1: "x"})),
])
def test_chat_options_that_cannot_apply_are_refused_naming_them(tok, field, fields):
    with pytest.raises(ValidationError) as info:
        validate(tok, messages=USER, **fields)
    assert info.value.field == field and field in str(info.value)
