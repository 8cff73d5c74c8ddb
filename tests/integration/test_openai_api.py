"""The OpenAI-compatible HTTP API of a running stack, driven with the official openai package: its routes,
streaming, errors and structured output, and the same answers as the gRPC API. Each sampling parameter on both
APIs: test_sampling_parameters.py."""
from __future__ import annotations

import asyncio
import importlib.metadata
import io
import json
import re
import time

import grpc
import httpx
import jsonschema
import openai
import pytest

from frontend.reasoning import split_reasoning
from pagedserve.client import build_request
from pagedserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.integration.conftest import MODEL
from tests.support.beam_reference import beam_score, reference_beam_search

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def num_running(api_stack) -> int:
    with api_stack.channel("scheduler_svc") as ch:
        stats = scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.SchedulerStatsRequest())
    return stats.num_running + stats.num_waiting


def test_models_health_tokenize_and_detokenize(api_stack, openai_client, tokenizer):
    assert [m.id for m in openai_client.models.list().data] == [MODEL]  # the model's own name, by default
    assert httpx.get(f"{api_stack.http_url}/health").status_code == 200
    assert httpx.get(f"{api_stack.http_url}/version").json() == {"version": importlib.metadata.version("pagedserve")}
    tokens = httpx.post(f"{api_stack.http_url}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    text = httpx.post(f"{api_stack.http_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == PROMPT


def test_return_token_ids_gives_the_prompts_and_each_choices_ids_whole_and_streamed(api_stack, tokenizer):
    # vLLM's return_token_ids: what RL trainers read back instead of re-tokenizing the text.
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)
    for path, inputs, prompt_ids in (("/v1/completions", {"prompt": PROMPT}, tokenizer.encode(PROMPT)),
                                     ("/v1/chat/completions", {"messages": CHAT}, chat_ids)):
        body = {"model": MODEL, **inputs, "temperature": 1.0, "seed": 5, "n": 2, "max_tokens": 8, "ignore_eos": True,
                "return_token_ids": True}
        whole = httpx.post(f"{api_stack.http_url}{path}", json=body, timeout=60).json()
        streamed = [json.loads(line[6:]) for line in httpx.post(
            f"{api_stack.http_url}{path}", json=body | {"stream": True}, timeout=60).text.splitlines()
            if line.startswith("data: {")]
        chat = "messages" in inputs
        assert (whole if chat else whole["choices"][0])["prompt_token_ids"] == prompt_ids
        assert (streamed[0] if chat else streamed[0]["choices"][0])["prompt_token_ids"] == prompt_ids
        for choice in whole["choices"]:
            text = choice["message"]["content"] if chat else choice["text"]
            assert len(choice["token_ids"]) == 8 and tokenizer.decode(choice["token_ids"]) == text
            # The same seeded choice, streamed: its chunks' ids add up to the whole answer's.
            ids = [t for event in streamed for c in event["choices"] if c["index"] == choice["index"]
                   for t in c["token_ids"]]
            assert ids == choice["token_ids"]
    plain = httpx.post(f"{api_stack.http_url}/v1/completions", json={"model": MODEL, "prompt": PROMPT}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_return_tokens_as_token_ids_names_each_logprobs_token_by_its_id(api_stack):
    # vLLM's: for tokens that do not decode alone (a part of a character), and for clients that count ids.
    def ids(names) -> list[int]:
        names = list(names)
        assert all(name.startswith("token_id:") for name in names), names
        return [int(name.removeprefix("token_id:")) for name in names]

    base = {"model": MODEL, "temperature": 0, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    completion = httpx.post(f"{api_stack.http_url}/v1/completions", timeout=60,
                            json=base | {"prompt": PROMPT, "logprobs": 2, "prompt_logprobs": 1}).json()["choices"][0]
    assert ids(completion["logprobs"]["tokens"]) == completion["token_ids"]
    assert all(len(ids(top)) == 2 for top in completion["logprobs"]["top_logprobs"])
    assert all(ids(e["decoded_token"] for e in entry.values()) == [int(i) for i in entry]
               for entry in completion["prompt_logprobs"][1:])
    chat = httpx.post(f"{api_stack.http_url}/v1/chat/completions", timeout=60,
                      json=base | {"messages": CHAT, "logprobs": True, "top_logprobs": 1, "stream": True}).text
    events = [json.loads(line[6:]) for line in chat.splitlines() if line.startswith("data: {")]
    streamed = [entry for e in events for c in e["choices"] for entry in (c["logprobs"] or {}).get("content", [])]
    assert ids(entry["token"] for entry in streamed) == [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in streamed)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beam_search_finds_the_beams_the_reference_finds(api_stack, hf_model, tokenizer, length_penalty):
    # Scores, not token ids, are compared: a near tie may order two beams apart in another float32 implementation.
    eos, width = tokenizer.eos_token_id, 3
    for path, inputs, prompt in (("/v1/completions", {"prompt": PROMPT}, tokenizer.encode(PROMPT)),
                                 ("/v1/chat/completions", {"messages": CHAT}, tokenizer.encode(
                                     tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                                     add_special_tokens=False))):
        answer = httpx.post(f"{api_stack.http_url}{path}", timeout=120, json={
            "model": MODEL, **inputs, "n": width, "max_tokens": 6, "use_beam_search": True,
            "length_penalty": length_penalty, "skip_special_tokens": False}).json()
        texts = [c["message"]["content"] if "messages" in inputs else c["text"] for c in answer["choices"]]
        beams = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        expected = reference_beam_search(hf_model, eos, prompt, width, 6, length_penalty)
        assert [beam_score(hf_model, eos, prompt, b, length_penalty) for b in beams] == \
            pytest.approx([s for _, s in expected], abs=1e-4)
        assert [c["finish_reason"] for c in answer["choices"]] == \
            ["stop" if tokens[-1] == eos else "length" for tokens, _ in expected]
        assert answer["usage"]["completion_tokens"] == sum(len(tokens) for tokens, _ in expected)


def test_greedy_completion_and_chat_equal_the_grpc_api(openai_client, grpc_client, tokenizer):
    grpc_text = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=24))
    completion = openai_client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24)
    assert completion.choices[0].text == grpc_text.text and grpc_text.text
    assert completion.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert completion.usage.completion_tokens == len(grpc_text.token_ids)

    grpc_chat = grpc_client.generate(build_request(messages=CHAT, temperature=0.0, max_tokens=24))
    chat = openai_client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    assert chat.choices[0].message.content == grpc_chat.text and "Paris" in grpc_chat.text
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_the_generate_command_prints_the_apis_answer(api_stack, grpc_client, capsys, monkeypatch):
    """`pagedserve generate`, the README's first try, with the prompt as an argument and from standard input."""
    from pagedserve.entrypoints import cli

    expected = grpc_client.generate(build_request(messages=CHAT, temperature=0.0, max_tokens=12))
    argv = ["generate", "--address", api_stack.address, "--chat", "--temperature", "0", "--max-tokens", "12"]
    assert cli.main([*argv, CHAT[0]["content"]]) == 0
    assert capsys.readouterr().out == expected.text + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(CHAT[0]["content"]))
    assert cli.main([*argv, "-"]) == 0
    assert capsys.readouterr().out == expected.text + "\n"
    assert cli.main([*argv, "--json", CHAT[0]["content"]]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == list(expected.token_ids)


def test_the_chat_command_carries_the_conversation(api_stack, grpc_client, capsys, monkeypatch):
    """`pagedserve chat`: each line of standard input is a turn; each answer is the API's for the conversation
    so far."""
    from pagedserve.entrypoints import cli

    turns = ["What is the capital of France?", "And of Italy?"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(turns) + "\n\n"))
    assert cli.main(["chat", "--address", api_stack.address, "--system", "Be brief.", "--temperature", "0",
                     "--max-tokens", "16"]) == 0
    printed = capsys.readouterr().out
    conversation = [{"role": "system", "content": "Be brief."}]
    expected = ""
    for turn in turns:
        conversation.append({"role": "user", "content": turn})
        answer = grpc_client.generate(build_request(messages=conversation, temperature=0.0, max_tokens=16)).text
        conversation.append({"role": "assistant", "content": answer})
        expected += answer + "\n"
    assert printed == expected and "Paris" in printed


def test_streaming_sync_and_async_give_the_same_text_and_a_final_usage_chunk(api_stack, openai_client):
    whole = openai_client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20)
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20,
                                                        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    async def stream_completion():
        async with openai.AsyncOpenAI(base_url=f"{api_stack.http_url}/v1", api_key="unused", max_retries=0) as aclient:
            whole = await aclient.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=20)
            stream = await aclient.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=20,
                                                      stream=True, stream_options={"include_usage": True})
            parts = [chunk async for chunk in stream]
            return whole, parts

    whole, parts = asyncio.run(stream_completion())
    assert len(parts) > 2, "tokens must arrive as a stream"
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens == 20


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(openai_client, tokenizer):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage of its own prompt and choice."""
    prompts = [PROMPT, "Once upon a time"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(openai_client.completions.create(model=MODEL, prompt=prompts, n=2, seed=1, temperature=1.0,
                                                   max_tokens=6, logprobs=0, stream=True, stream_options=options))
    generated = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        generated[choice.index] = generated.get(choice.index, 0) + len(choice.logprobs.tokens)
        prompt_tokens = len(tokenizer.encode(prompts[choice.index // 2]))
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (prompt_tokens, generated[choice.index])
        assert chunk.usage.total_tokens == prompt_tokens + generated[choice.index]
    assert generated == {0: 6, 1: 6, 2: 6, 3: 6}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24

    chat = list(openai_client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=5,
                                                      stream=True, stream_options=options))
    assert [c.usage.completion_tokens for c in chat if c.choices][-1] == chat[-1].usage.completion_tokens == 5
    assert all(c.usage is not None for c in chat)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}}},
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_named_and_required_come_whole_and_streamed(openai_client):
    """tool_choice naming a function, or "required": calls that parse and fit the tools' schemas, the same
    streamed (greedy) as whole; then the conversation goes on with the call and the tool's answer."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=80)
    whole = openai_client.chat.completions.create(**kwargs, tool_choice=named)
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id and whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])
    pieces = [piece for chunk in openai_client.chat.completions.create(**kwargs, tool_choice=named, stream=True)
              if chunk.choices for piece in chunk.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == "get_weather" and pieces[0].id and len(pieces) > 1
    assert "".join(piece.function.arguments for piece in pieces) == call.function.arguments

    required = openai_client.chat.completions.create(**kwargs, tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content is None
    for each in calls:
        jsonschema.validate(json.loads(each.function.arguments), schemas[each.function.name])
    streamed = [chunk.choices[0] for chunk in openai_client.chat.completions.create(
        **kwargs, tool_choice="required", stream=True) if chunk.choices]
    last = streamed[-1]
    assert last.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in last.delta.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls]

    answered = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                           {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    follow = openai_client.chat.completions.create(model=MODEL, messages=answered, tools=TOOLS, tool_choice="none",
                                                   temperature=0, max_tokens=20)
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_tool_choice_auto_reads_the_models_hermes_calls_or_gives_its_text(openai_client):
    """The stack serves with --enable-auto-tool-choice --tool-call-parser hermes. Shown two calls in the hermes
    syntax, the model writes a third, which comes back as a call, whole and streamed; asked a plain question, it
    answers in text."""
    system = {"role": "system", "content": 'To call a tool, answer with <tool_call>{"name": ..., "arguments": '
                                           '{...}}</tool_call>.'}
    shots = []
    for city in ("Rome", "Oslo"):
        call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
        shots += [{"role": "user", "content": f"What is the weather in {city}?"},
                  {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}]
    kwargs = dict(model=MODEL, messages=[system, *shots, *QUESTION], tools=TOOLS, temperature=0, max_tokens=60)
    whole = openai_client.chat.completions.create(**kwargs)
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert whole.choices[0].finish_reason == "tool_calls"
    streamed = [chunk.choices[0] for chunk in openai_client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices]
    [piece] = [piece for choice in streamed for piece in choice.delta.tool_calls or []]
    assert (piece.function.name, piece.function.arguments) == (call.function.name, call.function.arguments)
    assert streamed[-1].finish_reason == "tool_calls"

    text = openai_client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, temperature=0, max_tokens=16)
    assert "Paris" in text.choices[0].message.content and not text.choices[0].message.tool_calls


def test_the_responses_api_answers_as_chat_does_whole_and_streamed(openai_client):
    """/v1/responses over the chat path: the same greedy text as the chat API, usage, a cut-short answer
    incomplete; streamed, the typed events add up to the whole response; function tools and a conversation that
    carries a call and its output."""
    chat = openai_client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20)
    whole = openai_client.responses.create(model=MODEL, input=CHAT[0]["content"], temperature=0, max_output_tokens=20)
    assert whole.status == "completed" and whole.output_text == chat.choices[0].message.content
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)
    short = openai_client.responses.create(model=MODEL, input=CHAT, temperature=0, max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in short.output] == ["incomplete"] and short.output_text

    events = list(openai_client.responses.create(model=MODEL, input=CHAT[0]["content"], temperature=0,
                                                 max_output_tokens=20, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text

    tools = [{"type": "function", "name": tool["function"]["name"], "parameters": tool["function"]["parameters"]}
             for tool in TOOLS]
    called = openai_client.responses.create(model=MODEL, input=QUESTION, tools=tools, tool_choice="required",
                                            temperature=0, max_output_tokens=80)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and all(call.name in ("get_weather", "get_time") and json.loads(call.arguments) for call in calls)
    streamed = list(openai_client.responses.create(model=MODEL, input=QUESTION, tools=tools, temperature=0,
                                                   tool_choice={"type": "function", "name": "get_weather"},
                                                   max_output_tokens=80, stream=True))
    [done] = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert done.type == "function_call" and done.name == "get_weather"
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == done.arguments

    call = calls[0]
    answered = openai_client.responses.create(model=MODEL, tools=tools, tool_choice="none", temperature=0,
                                              max_output_tokens=10, input=[
        *QUESTION, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}])
    assert answered.output_text and answered.output[0].type == "message"


def test_stored_responses_continue_their_conversation_and_can_be_read_and_deleted(openai_client):
    """A response is stored unless the request says store false: previous_response_id continues its conversation
    (the same greedy answer as the chat API on the whole of it), GET reads it, DELETE removes it."""
    first = openai_client.responses.create(model=MODEL, input="My name is Ada. Say hello to me.", temperature=0,
                                           max_output_tokens=12, instructions="Answer briefly.")
    assert first.store and openai_client.responses.retrieve(first.id).output_text == first.output_text
    events = list(openai_client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                                 max_output_tokens=12, previous_response_id=first.id, stream=True))
    follow = events[-1].response
    assert follow.previous_response_id == first.id and follow.store
    chat = openai_client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "user", "content": "My name is Ada. Say hello to me."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert follow.output_text == chat.choices[0].message.content  # the first's instructions are not carried over
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert openai_client.responses.retrieve(follow.id).output_text == follow.output_text

    unstored = openai_client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert not unstored.store
    for missing in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            openai_client.responses.retrieve(missing)
        with pytest.raises(openai.NotFoundError) as refused:
            openai_client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, previous_response_id=missing)
        assert refused.value.body["param"] == "previous_response_id"
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)
    # An X-Request-Id may come again once its request has ended: each response keeps an id of its own.
    same = [openai_client.responses.create(model=MODEL, input=text, temperature=0, max_output_tokens=4,
                                           extra_headers={"X-Request-Id": "again"}) for text in ("Hi", "Bye")]
    assert same[0].id != same[1].id
    assert [openai_client.responses.retrieve(r.id).output_text for r in same] == [r.output_text for r in same]


def test_reasoning_splits_from_the_answer(openai_client, grpc_client):
    """The stack serves with --reasoning-parser qwen3. Shown two answers that think in <think> first, the model
    thinks too: the HTTP API splits its answer, whole and streamed, as the parser splits the gRPC API's raw text;
    the Responses API gives the thinking as a reasoning item."""
    shots = []
    for question, thought, answer in [("Hi!", "The user greets me.", "Hello!"),
                                      ("What is 2+2?", "Two and two make four.", "4.")]:
        shots += [{"role": "user", "content": question},
                  {"role": "assistant", "content": f"<think>{thought}</think>{answer}"}]
    messages = [{"role": "system", "content": "Think inside <think></think> before you answer."}, *shots, *CHAT]
    raw = grpc_client.generate(build_request(messages=messages, temperature=0.0, max_tokens=40)).text
    assert raw.startswith("<think>") and "</think>" in raw, raw
    reasoning, content = split_reasoning("qwen3", raw)
    whole = openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    assert (whole.choices[0].message.reasoning, whole.choices[0].message.content) == (reasoning, content)
    assert reasoning and "<think>" not in content
    deltas = [c.choices[0].delta for c in openai_client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content

    answered = openai_client.responses.create(model=MODEL, input=messages, temperature=0, max_output_tokens=40)
    assert [item.type for item in answered.output] == ["reasoning", "message"][: len(answered.output)]
    assert answered.output[0].content[0].text == reasoning and answered.output_text == content


def test_echo_with_logprobs_streams_the_prompts_logprobs_first_for_every_choice(openai_client, tokenizer):
    kwargs = dict(model=MODEL, prompt=PROMPT, n=2, seed=3, temperature=1.0, max_tokens=5, echo=True, logprobs=1)
    whole = openai_client.completions.create(**kwargs)
    num_prompt = len(tokenizer.encode(PROMPT))
    first = whole.choices[0].logprobs
    for choice in whole.choices:  # each choice echoes the prompt, and its logprobs (asked of the first only)
        assert choice.text.startswith(PROMPT) and len(choice.logprobs.tokens) == num_prompt + 5
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        assert choice.logprobs.token_logprobs[:num_prompt] == first.token_logprobs[:num_prompt]
    assert whole.choices[0].text != whole.choices[1].text
    parts = [c for c in openai_client.completions.create(**kwargs, stream=True) if c.choices]
    for index, choice in enumerate(whole.choices):
        mine = [p.choices[0] for p in parts if p.choices[0].index == index]
        assert "".join(c.text for c in mine) == choice.text
        streamed = [lp for c in mine for lp in c.logprobs.token_logprobs]
        assert streamed[0] is None and streamed[1:] == pytest.approx(choice.logprobs.token_logprobs[1:])
        assert len(mine[0].logprobs.tokens) == num_prompt + 1, "the prompt's logprobs come with the first chunk"
        # Offsets into the choice's whole text, not restarting with each chunk (ASCII here: one per character).
        assert [o for c in mine for o in c.logprobs.text_offset] == choice.logprobs.text_offset


def test_echo_with_no_tokens_scores_the_prompt_alone(openai_client, tokenizer):
    """vLLM's way to score a prompt (echo, max_tokens 0): its text and logprobs, those of a completion's echo,
    and nothing generated, whole or streamed, for every prompt of a batch."""
    prompts = [PROMPT, "Once upon a time"]
    kwargs = dict(model=MODEL, prompt=prompts, echo=True, logprobs=2, temperature=0)
    scored = openai_client.completions.create(**kwargs, max_tokens=0)
    completed = openai_client.completions.create(**kwargs, max_tokens=1)
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    streamed = [c.choices[0] for c in openai_client.completions.create(**kwargs, max_tokens=0, stream=True)
                if c.choices]
    for prompt, score, completion in zip(prompts, scored.choices, completed.choices):
        num_prompt = len(tokenizer.encode(prompt))
        assert score.text == prompt and score.finish_reason == "length"
        assert score.logprobs.tokens == completion.logprobs.tokens[:num_prompt]
        assert score.logprobs.token_logprobs == completion.logprobs.token_logprobs[:num_prompt]
        assert score.logprobs.top_logprobs == completion.logprobs.top_logprobs[:num_prompt]
        mine = [c for c in streamed if c.index == score.index]
        assert "".join(c.text for c in mine) == prompt
        assert [t for c in mine for t in c.logprobs.tokens] == score.logprobs.tokens


BAD = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),  # (0 only with echo)
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "priority": 2**40}, "priority"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 1.5}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "seed": "x"}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 3}, "stop"),
    # Numbers wider than their fields on the wire.
    ("/v1/completions", {"prompt": PROMPT, "top_k": 1 << 31}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 1 << 64}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [10**7]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"12": 500}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": [5], "guided_regex": "a+"}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [7], "bad_words": ["x"], "min_tokens": 1,
                         "stop_token_ids": [7]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "bad_words": [" "]}, "bad_words"),
    ("/v1/completions", {"prompt": PROMPT, "bad_words": "word"}, "bad_words"),
    ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 4, "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 200_000}, "prompt"),
    ("/v1/completions", {"prompt": [10**8]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "json_schema",
                                                                "json_schema": {"schema": {"type": 5}}}},
     "response_format"),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    # Images: a vision-language checkpoint serves its language model alone.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": PROMPT, "guided_regex": "[a-"}, "guided_regex"),
    ("/v1/completions", {"prompt": PROMPT, "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": PROMPT, "guided_grammar": "root ::= "}, "guided_grammar"),
    ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {}}, "structured_outputs"),
    ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
     "structured_outputs"),
    ("/v1/completions", {"prompt": PROMPT, "guided_grammar": 'root ::= "a"', "guided_regex": "a"}, "guided_grammar"),
    ("/v1/completions", {"prompt": PROMPT, "guided_choice": ["a", ""]}, "guided_choice"),
    ("/v1/completions", {"prompt": PROMPT, "guided_json": {"type": 5}}, "guided_json"),
    ("/v1/completions", {"prompt": PROMPT, "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "guided_regex": "a+", "response_format": {"type": "json_object"}},
     "guided_regex"),
    # The Responses API.
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/responses", {"input": [{"type": "image", "url": "x"}]}, "input"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "temperature": -1}, "temperature"),
    ("/v1/responses", {"input": "hi", "background": True}, "background"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": 5}}}}, "text"),
    ("/v1/responses", {"input": [{"role": "wizard", "content": "hi"}]}, "input"),
    # Tools ("auto" on a server without a parser: tests/unit/test_tools.py).
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {}}],
                              "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": 5}}}], "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    # vLLM's parameters this server does not implement: refused where they would change the answer.
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 11}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "use_beam_search": True, "guided_regex": "a"}, "guided_regex"),
    ("/v1/chat/completions", {"messages": CHAT, "use_beam_search": True, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "use_beam_search": True, "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/completions", {"prompt": PROMPT, "logits_processors": ["x"]}, "logits_processors"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", {"prompt": PROMPT, "return_token_ids": 1}, "return_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"messages": CHAT, "documents": [{"text": "x"}]}, "documents"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("structure,holds", [
    ({"json": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
               "additionalProperties": False}},
     lambda text: isinstance(json.loads(text)["city"], str)),
    ({"regex": r"[A-Z][a-z]{2,8} \d{2}"}, lambda text: bool(re.fullmatch(r"[A-Z][a-z]{2,8} \d{2}", text))),
    ({"choice": ["north", "south"]}, lambda text: text in ("north", "south")),
    ({"grammar": 'root ::= "It is " ("yes" | "no") "."'}, lambda text: text in ("It is yes.", "It is no.")),
    ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
])
def test_vllms_structured_outputs_constrain_the_answer(openai_client, structure, holds):
    # vLLM's successor of the guided_* fields (which it no longer takes): ignored, it would leave the answer free.
    # Each structure's answers are short enough to end within max_tokens, sampled too, but an object of free keys:
    # sampled, it may still be open there (json_object's own test below counts how often).
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        answer = openai_client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=40, extra_body={"structured_outputs": structure, **extra})
        text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
        if finish == "length" and "json_object" in structure and "seed" in extra:
            assert text.startswith("{"), text
            continue
        assert finish == "stop" and holds(text), text


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_parameters_get_a_400_naming_them(api_stack, path, body, param):
    response = httpx.post(f"{api_stack.http_url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"], error["message"]  # the message names the field too


@pytest.mark.parametrize("model", ["gpt-4", "default"])
def test_a_model_it_does_not_serve_is_not_found(api_stack, model):
    for path, body in [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})]:
        response = httpx.post(f"{api_stack.http_url}{path}", json={"model": model, **body}, timeout=60)
        assert response.status_code == 404, response.text
        assert response.json()["error"] | {"message": ""} == {"message": "", "type": "not_found_error",
                                                              "param": "model", "code": "model_not_found"}


def test_the_server_carries_on_after_bad_requests_and_refuses_them_on_grpc_too(api_stack, openai_client, grpc_client):
    assert httpx.post(f"{api_stack.http_url}/v1/completions", content=b"{not json").status_code == 400
    assert httpx.get(f"{api_stack.http_url}/v1/nothing").json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model=MODEL, prompt=PROMPT, presence_penalty=5)
    with pytest.raises(grpc.RpcError) as raised:
        grpc_client.generate(build_request(PROMPT, logit_bias={10**7: 1.0}))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in raised.value.details()
    assert openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


@pytest.mark.parametrize("prompts", [1, 3])
def test_a_client_that_disconnects_aborts_its_requests(api_stack, openai_client, prompts):
    stream = openai_client.completions.create(model=MODEL, prompt=[PROMPT] * prompts, max_tokens=2000, stream=True,
                                              extra_body={"ignore_eos": True})
    next(iter(stream))
    end = time.monotonic() + 10
    while num_running(api_stack) < prompts and time.monotonic() < end:
        time.sleep(0.05)
    assert num_running(api_stack) == prompts
    stream.close()
    end = time.monotonic() + 10
    while num_running(api_stack) and time.monotonic() < end:
        time.sleep(0.1)
    assert num_running(api_stack) == 0


def test_a_client_that_gives_up_on_a_whole_response_aborts_its_request(api_stack):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api_stack.http_url}/v1/completions", json=body, timeout=2)
    end = time.monotonic() + 10
    while num_running(api_stack) and time.monotonic() < end:
        time.sleep(0.1)
    assert num_running(api_stack) == 0


def _check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_json_schema_output_validates_greedy_and_sampled(api_stack, openai_client, grpc_client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    messages = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    greedy = openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=64,
                                                   response_format=response_format)
    _check_json(greedy.choices[0].message.content, PERSON_SCHEMA)
    assert greedy.choices[0].finish_reason == "stop"
    completion = openai_client.completions.create(model=MODEL, prompt="A person:", temperature=0, max_tokens=64,
                                                  extra_body={"response_format": response_format})
    _check_json(completion.choices[0].text, PERSON_SCHEMA)
    grpc = grpc_client.generate(build_request(messages=messages, temperature=0.0, max_tokens=64,
                                              json_schema=json.dumps(PERSON_SCHEMA)))
    assert grpc.text == greedy.choices[0].message.content

    async def sampled():
        async with openai.AsyncOpenAI(base_url=f"{api_stack.http_url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(
                aclient.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, seed=seed,
                                                max_tokens=64, response_format=response_format)
                for seed in range(20)))

    outputs = [r.choices[0].message.content for r in asyncio.run(sampled())]
    for text in outputs:
        _check_json(text, PERSON_SCHEMA)
    assert len(set(outputs)) > 1

    # An object of free keys, sampled at temperature 1, may still be open when max_tokens ends it (6 seeds of 30
    # here): every answer that ends is an object, and most end.
    async def objects():
        async with openai.AsyncOpenAI(base_url=f"{api_stack.http_url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(
                aclient.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, seed=seed,
                                                max_tokens=64, response_format={"type": "json_object"})
                for seed in range(10)))

    ended = [r.choices[0].message.content for r in asyncio.run(objects()) if r.choices[0].finish_reason == "stop"]
    assert len(ended) >= 5 and all(isinstance(json.loads(text), dict) for text in ended), ended


def scrape(api_stack) -> dict[tuple[str, str | None], float]:
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{api_stack.http_url}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(sample.name, sample.labels.get("finished_reason")): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples
            if sample.labels.get("model_name") == MODEL}


def test_metrics_count_each_request_and_show_the_back_ends_state(api_stack, openai_client, tokenizer):
    before = scrape(api_stack)
    prompt = "Count these metrics, please:"
    completion = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                                  extra_body={"ignore_eos": True})
    after = scrape(api_stack)

    def grew(name: str, reason: str | None = None) -> float:
        return after.get((name, reason), 0) - before.get((name, reason), 0)

    assert completion.usage.completion_tokens == 5
    assert grew("pagedserve:generation_tokens_total") == 5
    assert grew("pagedserve:prompt_tokens_total") == len(tokenizer.encode(prompt)) == completion.usage.prompt_tokens
    assert grew("pagedserve:request_success_total", "length") == 1
    assert grew("pagedserve:time_to_first_token_seconds_count") == 1
    assert grew("pagedserve:request_queue_time_seconds_count") == grew("pagedserve:request_prefill_time_seconds_count") == 1
    # The scheduler's share of the time to first token, on its own clock, fits inside the frontend's.
    ttft = grew("pagedserve:time_to_first_token_seconds_sum")
    assert 0 < grew("pagedserve:request_queue_time_seconds_sum") + grew("pagedserve:request_prefill_time_seconds_sum") <= ttft
    assert grew("pagedserve:inter_token_latency_seconds_count") == 4
    assert 0 < grew("pagedserve:e2e_request_latency_seconds_sum") < 120
    assert grew("pagedserve:prefix_cache_queries_total") >= completion.usage.prompt_tokens - 1
    # Nothing else runs, and the finished request's blocks go back to the pool (a step later at most).
    deadline = time.monotonic() + 10
    while True:
        state = [after[(name, None)] for name in ("pagedserve:num_requests_running",
                                                  "pagedserve:num_requests_waiting", "pagedserve:kv_cache_usage_perc")]
        if state == [0, 0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
        after = scrape(api_stack)
    assert state == [0, 0, 0]


def test_a_list_of_prompts_answers_each_with_its_choices_in_order(api_stack, openai_client, tokenizer):
    prompts = ["The three primary colors are", "Paris is the capital of", "One, two, three,"]
    alone = [openai_client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True}) for p in prompts]
    batch = openai_client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2,
                                             extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * 6

    ids = [tokenizer.encode(p) for p in prompts[:2]]
    streamed: dict[int, str] = {}
    chunks = list(openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: alone[0].choices[0].text, 1: alone[1].choices[0].text}
    assert chunks[-1].usage.prompt_tokens == len(ids[0]) + len(ids[1]) and chunks[-1].usage.completion_tokens == 12


def test_a_bad_prompt_in_a_list_refuses_the_request_naming_it(api_stack):
    body = {"model": MODEL, "prompt": ["fine", "", "also fine"], "max_tokens": 2}
    response = httpx.post(f"{api_stack.http_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt 1: ")
    too_many = {"model": MODEL, "prompt": ["x"] * 257, "max_tokens": 1}
    assert httpx.post(f"{api_stack.http_url}/v1/completions", json=too_many, timeout=60).status_code == 400
    assert num_running(api_stack) == 0


def test_the_grpc_api_answers_reflection(api_stack):
    """As grpcurl asks: the services, then the Generation service's methods and their messages."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(api_stack.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= set(database.get_services())
        generation = DescriptorPool(database).FindServiceByName("pagedserve.v1.Generation")
        methods = {method.name: method for method in generation.methods}
    assert set(methods) == {"Generate", "GetModelInfo"}
    assert methods["Generate"].input_type.fields_by_name["sampling"].message_type.fields_by_name["regex"]
