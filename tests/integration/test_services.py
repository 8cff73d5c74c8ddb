"""The four services as real processes on free ports, driven through the public gRPC API."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig
from pagedserve.convert import FINISH_REASON_NAMES
from pagedserve.entrypoints.launcher import Stack
from pagedserve.output import Usage
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a CPU cache is.",
    "Name three rivers in Europe.",
]


@pytest.fixture(scope="module")
def stack():
    config = PagedServeConfig.from_kwargs(model="default", device="cpu", dtype="float32", port=0,
                                          kv_cache_memory=256 << 20, log_level="WARNING")
    with Stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    with GenerateClient(stack.address) as c:
        yield c


def hf_greedy_choices(hf_model, prompt_ids: list[int], token_ids: list[int]) -> list[int]:
    """transformers' greedy choice at each of the output's positions, given the tokens before it: equal to the
    output exactly where the output is transformers' greedy decoding (one forward pass, teacher-forced, rather
    than generate's one per token)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + token_ids[:-1]])).logits[0, len(prompt_ids) - 1:]
    return logits.argmax(-1).tolist()


def kv_stats(stack) -> kvcache_pb2.KVCacheStats:
    with stack.channel("kvcache_svc") as ch:
        return kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.KVCacheStatsRequest())


def scheduler_stats(stack) -> scheduler_pb2.SchedulerStats:
    with stack.channel("scheduler_svc") as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.SchedulerStatsRequest())


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_streamed_greedy_output_equals_transformers(client, hf_model):
    for prompt in PROMPTS:
        request = build_request(messages=[{"role": "user", "content": prompt}], temperature=0.0, max_tokens=40)
        chunks = list(client.stream(request))
        assert len(chunks) > 1, "tokens must arrive as a stream"
        token_ids = [t for chunk in chunks for t in chunk.token_ids]
        assert chunks[-1].finish_reason in (1, 2)  # stop or length
        assert all(c.finish_reason == 0 for c in chunks[:-1])
        prompt_ids = hf_model_prompt_ids(prompt)
        assert token_ids == hf_greedy_choices(hf_model, prompt_ids, token_ids)
        eos = hf_model.generation_config.eos_token_id
        assert len(token_ids) == 40 or token_ids[-1] in (eos if isinstance(eos, list) else [eos])
        assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
        assert chunks[-1].usage.completion_tokens == len(token_ids)


def hf_model_prompt_ids(prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("default"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_answer_is_sensible(client):
    completion = client.generate(build_request(
        messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0.0, max_tokens=32
    ))
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"


def test_32_concurrent_streams_all_complete_and_match_transformers(stack, client, hf_model):
    rng = random.Random(0)
    requests = [
        [rng.randrange(100, 40000) for _ in range(rng.randint(8, 40))] for _ in range(32)
    ]
    results: dict[int, list[int]] = {}
    errors: list[Exception] = []

    def run(i: int) -> None:
        try:
            completion = client.generate(build_request(prompt_token_ids=requests[i], temperature=0.0,
                                                       max_tokens=12, ignore_eos=True))
            assert completion.finish_reason == "length"
            results[i] = completion.token_ids
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(results) == 32
    for i, prompt_ids in enumerate(requests):
        assert len(results[i]) == 12 and results[i] == hf_greedy_choices(hf_model, prompt_ids, results[i]), i


def test_cancelled_stream_frees_its_blocks(stack, client):
    assert wait_for(lambda: kv_stats(stack).num_in_use == 0)
    idle = kv_stats(stack)
    request = build_request(prompt="Tell me a very long story about dragons.", temperature=0.0,
                            max_tokens=2000, ignore_eos=True)
    stream = client.stream(request)
    received = 0
    for response in stream:
        received += len(response.token_ids)
        if received >= 5:
            break
    assert kv_stats(stack).num_in_use > 0
    stream.cancel()
    assert wait_for(lambda: kv_stats(stack).num_in_use == idle.num_in_use, timeout=10)
    assert kv_stats(stack).num_requests == 0


@pytest.mark.parametrize(
    "fields,field_name",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", max_tokens=10**7), "max_tokens"),
        (dict(prompt="hi", temperature=-0.5), "temperature"),
        (dict(prompt="hi", top_p=0.0), "top_p"),
        (dict(prompt="hi", top_p=1.5), "top_p"),
        (dict(prompt="hi", top_k=-2), "top_k"),
        (dict(prompt_token_ids=[1, 2, 10**8]), "prompt_token_ids"),
        (dict(prompt="word " * 9000), "prompt"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(client, fields, field_name):
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(build_request(**fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in caught.value.details()


def test_bad_input_does_not_disturb_other_streams(client):
    good = {}

    def run() -> None:
        good["completion"] = client.generate(build_request(prompt="Count to ten:", temperature=0.0, max_tokens=24,
                                                           ignore_eos=True))

    thread = threading.Thread(target=run)
    thread.start()
    for _ in range(5):
        with pytest.raises(grpc.RpcError):
            client.generate(build_request(prompt="hi", temperature=-1.0))
    thread.join(timeout=120)
    assert len(good["completion"].token_ids) == 24


def test_stop_strings_trim_the_text_and_end_the_request(stack, client):
    base = client.generate(build_request(prompt="1, 2, 3, 4,", temperature=0.0, max_tokens=20, ignore_eos=True))
    assert " 6" in base.text
    stopped = client.generate(build_request(prompt="1, 2, 3, 4,", temperature=0.0, max_tokens=20,
                                            ignore_eos=True, stop=[" 6"]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == base.text[: base.text.index(" 6")]
    assert wait_for(lambda: kv_stats(stack).num_requests == 0)


# (prompt, stop, include_stop_str_in_output, the stop string that should end the request), greedy,
# 24 tokens, ignore_eos. The comments say what the default model writes.
STOP_CASES = [
    ("1, 2, 3, 4,", [" 7, 8"], False, " 7, 8"),  # " 5, 6, 7, 8, ...": the stop spans five tokens
    ("1, 2, 3, 4,", [" 7, 8"], True, " 7, 8"),
    ("The capital of France is", ["answer", "\n\n"], False, "\n\n"),  # " Paris.\n\nThe answer is: ..."
    ("Once upon a time", ["never in this story"], False, None),
    ("Once upon a time", ["years went by"], False, "years went by"),  # the 24th token is " by"
]


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32", kv_cache_memory=128 << 20)


def test_offline_stop_strings_give_the_generate_apis_output(stack, client, llm):
    common = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [case[0] for case in STOP_CASES]
    full = llm.generate(prompts, SamplingParams(**common))
    # One batch: a request aborted on its stop string leaves the others running.
    offline = llm.generate(prompts, [
        SamplingParams(**common, stop=stop, include_stop_str_in_output=include) for _, stop, include, _ in STOP_CASES
    ])
    for (prompt, stop, include, ends_on), unstopped, result in zip(STOP_CASES, full, offline):
        streamed = client.generate(build_request(prompt=prompt, stop=stop, include_stop_str_in_output=include, **common))
        assert (result.text, result.finish_reason, result.token_ids) == (
            streamed.text, streamed.finish_reason, streamed.token_ids
        )
        assert result.usage == Usage(streamed.prompt_tokens, len(streamed.token_ids))
        if ends_on is None:
            assert (result.text, result.finish_reason) == (unstopped.text, "length")
            assert result.token_ids == unstopped.token_ids
            continue
        start = unstopped.text.index(ends_on)
        assert result.text == unstopped.text[:start + len(ends_on) if include else start]
        assert result.finish_reason == "stop"
        # Aborted at the token that completed the stop string: no token after it is reported.
        n = next(n for n in range(1, 25) if ends_on in llm.tokenizer.decode(unstopped.token_ids[:n]))
        assert result.token_ids == unstopped.token_ids[:n]
    assert len(offline[-1].token_ids) == 24  # the last case is the one completed by the last token
    assert wait_for(lambda: kv_stats(stack).num_requests == 0)


def settled_stats(stack) -> scheduler_pb2.SchedulerStats:
    """The scheduler's stats once nothing runs and every step it planned has come back and been applied
    (with steps planned ahead, up to three may be out at any moment)."""
    def settled():
        stats = scheduler_stats(stack)
        planned = stats.kv_rpcs + stats.kv_calls_skipped
        return stats.num_running == 0 and planned == stats.executor_rpcs == stats.num_steps
    assert wait_for(settled)
    return scheduler_stats(stack)


def test_two_rpcs_per_step_whatever_the_batch_size(stack, client):
    before = settled_stats(stack)
    threads = [
        threading.Thread(target=client.generate, args=(build_request(
            prompt_token_ids=[100 + i, 200, 300], temperature=0.0, max_tokens=8, ignore_eos=True),))
        for i in range(16)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    after = settled_stats(stack)
    steps = after.num_steps - before.num_steps
    assert steps > 0
    # One call to the block manager per step, but for steps planned on slots reserved ahead (three out).
    assert (after.kv_rpcs - before.kv_rpcs) + (after.kv_calls_skipped - before.kv_calls_skipped) == steps
    assert after.executor_rpcs - before.executor_rpcs == steps


def test_shared_prefix_is_served_from_the_cache_and_counted(stack, client):
    prefix = list(range(1000, 1000 + 64))  # four full blocks
    before = kv_stats(stack)
    first = client.generate(build_request(prompt_token_ids=prefix + [5, 6], temperature=0.0, max_tokens=4,
                                          ignore_eos=True, cache_salt="prefix-test"))
    middle = kv_stats(stack)
    second = client.generate(build_request(prompt_token_ids=prefix + [5, 6], temperature=0.0, max_tokens=4,
                                           ignore_eos=True, cache_salt="prefix-test"))
    after = kv_stats(stack)
    assert second.token_ids == first.token_ids
    assert middle.prefix_cache_hits == before.prefix_cache_hits
    assert after.prefix_cache_hits - middle.prefix_cache_hits == 64
    assert after.prefix_cache_queries - middle.prefix_cache_queries == 66


def test_one_step_at_a_time_and_a_stream_interval_stream_what_steps_planned_ahead_stream(stack, client):
    """The same concurrent streams through a stack without async scheduling and with a stream interval of 4:
    the same tokens, texts and finish reasons (requests ending on EOS, on a stop string and on max_tokens among
    them), the pools idle, and the messages carry 4 tokens each but for a request's first two and its last."""
    requests = [build_request(messages=[{"role": "user", "content": prompt}], temperature=0.0, max_tokens=40)
                for prompt in PROMPTS]
    requests += [build_request(prompt="1, 2, 3, 4,", temperature=0.0, max_tokens=20, stop=[" 7"]),
                 build_request(prompt_token_ids=[100, 200, 300], temperature=0.0, max_tokens=9, ignore_eos=True)]

    def run_all(generate_client) -> tuple[list, list]:
        """Each request's (tokens, text, finish reason), and the tokens of each of its messages."""
        with ThreadPoolExecutor(len(requests)) as pool:
            streams = list(pool.map(lambda request: list(generate_client.stream(request)), requests))
        outcomes = [([t for m in stream for t in m.token_ids], "".join(m.text for m in stream),
                     FINISH_REASON_NAMES[stream[-1].finish_reason]) for stream in streams]
        return outcomes, [[list(m.token_ids) for m in stream] for stream in streams]

    ahead, per_step = run_all(client)
    assert {finish for _, _, finish in ahead} == {"stop", "length"}
    assert any(len(m) < 4 for messages in per_step for m in messages[1:-1])  # without the interval, some do not
    config = PagedServeConfig.from_kwargs(model="default", device="cpu", dtype="float32", port=0,
                                          kv_cache_memory=256 << 20, log_level="WARNING", async_scheduling=False,
                                          stream_interval=4)
    with Stack(config) as one_at_a_time, GenerateClient(one_at_a_time.address) as other:
        outcomes, batched = run_all(other)
        assert outcomes == ahead
        for messages, (token_ids, _, _) in zip(batched, ahead):
            assert [t for m in messages for t in m] == token_ids
            # The first token at once, then a run up to the request's phase, then runs of 4, then the rest.
            assert all(len(m) >= 4 for m in messages[2:-1]), messages
            assert len(messages) <= 3 + len(token_ids) // 4
        assert wait_for(lambda: kv_stats(one_at_a_time).num_requests == 0)
        assert scheduler_stats(one_at_a_time).steps_out_limit == 1
    assert wait_for(lambda: kv_stats(stack).num_requests == 0)
    # Planned ahead: two steps out, or three while the loop's own work took most of a step (its share, reported).
    ahead_stats = scheduler_stats(stack)
    assert ahead_stats.steps_out_limit in (2, 3) and 0 < ahead_stats.loop_work_share < 1
