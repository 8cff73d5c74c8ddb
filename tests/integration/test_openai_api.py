"""The OpenAI-compatible HTTP API of a running stack, driven with the official openai package, and the same
sampling parameters on the gRPC API."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import jsonschema
import openai
import pytest

from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig
from pagedserve.entrypoints.launcher import Stack
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

MODEL = "smollm2"
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


@pytest.fixture(scope="module")
def stack():
    config = PagedServeConfig.from_kwargs(model="default", device="cpu", port=0, kv_cache_memory=256 << 20,
                                          log_level="WARNING", served_model_name=MODEL)
    with Stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(stack):
    with GenerateClient(stack.address) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


def kv_stats(stack) -> kvcache_pb2.KVCacheStats:
    with stack.channel("kvcache_svc") as ch:
        return kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.KVCacheStatsRequest())


def num_running(stack) -> int:
    with stack.channel("scheduler_svc") as ch:
        stats = scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.SchedulerStatsRequest())
    return stats.num_running + stats.num_waiting


def test_models_health_tokenize_and_detokenize(stack, client, tokenizer):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{stack.http_url}/health").status_code == 200
    tokens = httpx.post(f"{stack.http_url}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    text = httpx.post(f"{stack.http_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == PROMPT


def test_greedy_completion_and_chat_equal_the_grpc_api(client, grpc_client, tokenizer):
    grpc_text = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=24))
    completion = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24)
    assert completion.choices[0].text == grpc_text.text and grpc_text.text
    assert completion.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert completion.usage.completion_tokens == len(grpc_text.token_ids)

    grpc_chat = grpc_client.generate(build_request(messages=CHAT, temperature=0.0, max_tokens=24))
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    assert chat.choices[0].message.content == grpc_chat.text and "Paris" in grpc_chat.text
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_streaming_sync_and_async_give_the_same_text_and_a_final_usage_chunk(stack, client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    async def stream_completion():
        async with openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0) as aclient:
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


def test_n_seeded_choices_are_reproducible_and_share_the_prompt_blocks(stack, client):
    prompt = "Write one sentence about the sea. " * 6  # several full KV blocks
    before = kv_stats(stack)
    kwargs = dict(model=MODEL, prompt=prompt, n=3, seed=1234, temperature=1.0, max_tokens=12,
                  extra_body={"cache_salt": "n-test"})  # its own prefix-cache namespace: no earlier hits
    first = client.completions.create(**kwargs)
    after = kv_stats(stack)
    second = client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "seeded choices must differ from each other"
    assert first.usage.completion_tokens == 36
    # The two siblings were admitted on the first choice's blocks: every full block but the one holding
    # the last prompt token (always computed) was a hit, twice.
    num_prompt = first.usage.prompt_tokens
    shared = (num_prompt - 1) // 16 * 16
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2 * shared > 0


def test_n_on_grpc_gives_indexed_choices(grpc_client):
    responses = list(grpc_client.stream(build_request(PROMPT, n=2, seed=7, temperature=1.0, max_tokens=6)))
    finished = [r for r in responses if r.finish_reason]
    assert sorted(r.index for r in finished) == [0, 1]
    assert all(r.usage.completion_tokens == 6 for r in finished)


def test_stop_strings_cut_the_text(client, grpc_client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=24, stop=[stop])).text == \
        cut.choices[0].text


def test_logprobs_are_consistent_under_greedy(client):
    completion = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8 == completion.usage.completion_tokens
    assert "".join(logprobs.tokens) == completion.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values())) and top[token] == pytest.approx(logprob)

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob >= entry.top_logprobs[1].logprob


def test_stopping_parameters_on_both_apis(client, grpc_client):
    greedy = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=8))
    # stop_token_ids: ends at (and keeps) that token.
    stop_id = greedy.token_ids[3]
    stopped = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=8, stop_token_ids=[stop_id]))
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_id) + 1]
    http = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, logprobs=0,
                                     extra_body={"stop_token_ids": [stop_id]})
    assert http.usage.completion_tokens == len(stopped.token_ids) and http.choices[0].finish_reason == "stop"
    # min_tokens: the stop token cannot come first.
    first = greedy.token_ids[0]
    held = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=3, stop_token_ids=[first],
                                              min_tokens=2))
    assert held.token_ids[0] != first and len(held.token_ids) >= 2
    # ignore_eos: exactly max_tokens, even past the end of sentence.
    long = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=40,
                                          extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 40 and long.choices[0].finish_reason == "length"


def test_logit_bias_and_penalties_on_both_apis(client, grpc_client, tokenizer):
    forced = tokenizer.encode(" banana")[0]
    http = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4,
                                     logit_bias={str(forced): 100})
    assert http.choices[0].text == " banana" * 4
    grpc = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=4, logit_bias={forced: 100.0}))
    assert grpc.token_ids == [forced] * 4
    # A frequency penalty on top of that bias: the penalty grows with each repeat until another token wins.
    penalized = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=12, logit_bias={forced: 15.0},
                                                   frequency_penalty=2.0))
    unpenalized = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=12, logit_bias={forced: 15.0}))
    assert penalized.token_ids.count(forced) < unpenalized.token_ids.count(forced)
    # Presence and repetition penalties change greedy text, the same on both APIs.
    plain = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=24))
    for name in ("presence_penalty", "repetition_penalty"):
        g = grpc_client.generate(build_request(PROMPT, temperature=0.0, max_tokens=24, **{name: 2.0}))
        h = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24,
                                      **({name: 2.0} if name == "presence_penalty" else {"extra_body": {name: 2.0}}))
        assert g.token_ids != plain.token_ids, name
        assert h.choices[0].text == g.text, name


def test_sampling_filters_on_http_equal_grpc(client, grpc_client):
    kwargs = dict(temperature=0.8, top_p=0.9, seed=42, max_tokens=12)
    extra = dict(top_k=20, min_p=0.05)
    grpc = grpc_client.generate(build_request(PROMPT, **kwargs, **extra))
    http = client.completions.create(model=MODEL, prompt=PROMPT, **kwargs, extra_body=extra)
    assert http.choices[0].text == grpc.text


def test_x_request_id_is_honoured(stack):
    response = httpx.post(f"{stack.http_url}/v1/completions", headers={"X-Request-Id": "my-id-1"},
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "my-id-1" and response.json()["id"] == "cmpl-my-id-1"


BAD = [
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
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
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [10**7]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"12": 500}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 200_000}, "prompt"),
    ("/v1/completions", {"prompt": [10**8]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "json_schema",
                                                                "json_schema": {"schema": {"type": 5}}}},
     "response_format"),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_parameters_get_a_400_naming_them(stack, path, body, param):
    response = httpx.post(f"{stack.http_url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_the_server_carries_on_after_bad_requests_and_refuses_them_on_grpc_too(stack, client, grpc_client):
    assert httpx.post(f"{stack.http_url}/v1/completions", content=b"{not json").status_code == 400
    assert httpx.get(f"{stack.http_url}/v1/nothing").json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, presence_penalty=5)
    with pytest.raises(grpc.RpcError) as raised:
        grpc_client.generate(build_request(PROMPT, logit_bias={10**7: 1.0}))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in raised.value.details()
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_a_client_that_disconnects_aborts_its_request(stack, client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2000, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    assert num_running(stack) == 1
    stream.close()
    end = time.monotonic() + 10
    while num_running(stack) and time.monotonic() < end:
        time.sleep(0.1)
    assert num_running(stack) == 0


def _check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_json_schema_output_validates_greedy_and_sampled(stack, client, grpc_client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    messages = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    greedy = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=64,
                                            response_format=response_format)
    _check_json(greedy.choices[0].message.content, PERSON_SCHEMA)
    assert greedy.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=MODEL, prompt="A person:", temperature=0, max_tokens=64,
                                           extra_body={"response_format": response_format})
    _check_json(completion.choices[0].text, PERSON_SCHEMA)
    grpc = grpc_client.generate(build_request(messages=messages, temperature=0.0, max_tokens=64,
                                              json_schema=json.dumps(PERSON_SCHEMA)))
    assert grpc.text == greedy.choices[0].message.content

    async def sampled():
        async with openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(
                aclient.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, seed=seed,
                                                max_tokens=64, response_format=response_format)
                for seed in range(20)))

    outputs = [r.choices[0].message.content for r in asyncio.run(sampled())]
    for text in outputs:
        _check_json(text, PERSON_SCHEMA)
    assert len(set(outputs)) > 1

    json_object = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, seed=3,
                                                 max_tokens=64, response_format={"type": "json_object"})
    assert isinstance(json.loads(json_object.choices[0].message.content), dict)
