"""Services killed with SIGKILL under load, through the public API of a supervised stack (a tiny random
Llama on the CPU): the supervisor restarts them on the same address, health reports the outage, and
requests either continue unharmed (scheduler, executor and KV-cache service killed: the executor's and
the block manager's requests are recomputed, or with Redis the block manager resumes its saved state) or
fail with UNAVAILABLE and run once when retried (frontend killed). Outputs are compared with the offline
LLM on the same model."""
from __future__ import annotations

import os
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve import LLM, SamplingParams
from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig
from pagedserve.entrypoints.launcher import Stack
from pagedserve.service import wait_until_serving
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support.probes import health, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Long enough that the outage is seen (health is polled every 0.5 s), short enough for a quick test.
RESTART_BACKOFF_S = 3.0


@pytest.fixture(scope="module")
def stack(model):
    config = PagedServeConfig.from_kwargs(
        model=model, device="cpu", port=0, log_level="WARNING", kv_cache_memory=64 << 20,
        restart_backoff=RESTART_BACKOFF_S, max_restarts=5,
    )
    with Stack(config) as stack:
        yield stack


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 150) for _ in range(rng.randint(4, 60))] for _ in range(count)]


def greedy(reference: LLM, requests: list[list[int]], max_tokens: int):
    """What a fault-free run gives: the offline LLM's greedy tokens and logprobs."""
    return reference.generate(requests, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                       logprobs=1))


def scheduler_stats(stack) -> scheduler_pb2.SchedulerStats:
    with stack.channel("scheduler_svc") as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)


def scheduler_load(stack) -> int:
    stats = scheduler_stats(stack)
    return stats.num_running + stats.num_waiting


def kv_stats(stack) -> kvcache_pb2.KVCacheStats:
    with stack.channel("kvcache_svc") as ch:
        return kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.KVCacheStatsRequest(), timeout=5)


def kv_idle(stack) -> bool:
    try:
        stats = kv_stats(stack)
    except grpc.RpcError:
        return False
    return stats.num_requests == 0 and stats.num_in_use == 0


def stream(client: GenerateClient, prompt: list[int], request_id: str, max_tokens: int,
           progress: dict | None = None) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    for response in client.stream(build_request(
        prompt_token_ids=prompt, request_id=request_id, temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
        logprobs=1,
    ), timeout=120):
        tokens.extend(response.token_ids)
        logprobs.extend(entry.logprob for entry in response.logprobs)
        if progress is not None:
            progress[request_id] = len(tokens)
    return tokens, logprobs


def load_with_a_kill(stack, service: str, requests: list[list[int]], max_tokens: int, tag: str):
    """Streams the requests 16 at a time and SIGKILLs the service once 30 have completed; returns each
    request's (tokens, logprobs) and how many were mid-stream at the kill."""
    progress: dict[str, int] = {}
    done = threading.Semaphore(0)

    def run(client: GenerateClient, i: int):
        try:
            return stream(client, requests[i], f"{tag}-{i}", max_tokens, progress)
        finally:
            done.release()

    old_pid = stack.processes[service].pid
    with GenerateClient(stack.address) as client, ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(run, client, i) for i in range(len(requests))]
        for _ in range(30):
            done.acquire()
        # Requests finish in waves: kill while one is part-way through its stream.
        wait_for(lambda: any(0 < n < max_tokens for n in list(progress.values())), timeout=30)
        midway = sum(1 for n in list(progress.values()) if 0 < n < max_tokens)
        os.kill(old_pid, signal.SIGKILL)
        results = [future.result() for future in futures]
    assert stack.processes[service].pid != old_pid, f"{service} was not restarted"
    return results, midway


def assert_matches(got: tuple[list[int], list[float]], want, label: str) -> None:
    tokens, logprobs = got
    assert tokens == want.token_ids, label
    # One logprob per token: none lost, none sent twice; equal to the reference's (a tiny random model's
    # greedy tokens barely depend on the context, its logprobs do).
    assert logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4), label


def test_scheduler_killed_under_load_every_stream_continues_unchanged(stack, reference):
    requests = prompts(100, seed=0)
    max_tokens = 32
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    expected = reference.generate(requests, params)

    progress: dict[int, int] = {}  # tokens received so far, per request
    done = threading.Semaphore(0)

    def run(client: GenerateClient, i: int) -> tuple[list[int], list[float]]:
        tokens, logprobs = [], []
        try:
            for response in client.stream(build_request(
                prompt_token_ids=requests[i], request_id=f"load-{i}", temperature=0.0, max_tokens=max_tokens,
                ignore_eos=True, logprobs=1,
            ), timeout=120):
                tokens.extend(response.token_ids)
                logprobs.extend(entry.logprob for entry in response.logprobs)
                progress[i] = len(tokens)
        finally:
            done.release()
        return tokens, logprobs

    old_pid = stack.processes["scheduler_svc"].pid
    with GenerateClient(stack.address) as client, ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(run, client, i) for i in range(len(requests))]
        for _ in range(30):
            done.acquire()
        wait_for(lambda: any(0 < n < max_tokens for n in list(progress.values())), timeout=30)
        midway = [i for i, n in list(progress.items()) if 0 < n < max_tokens]
        os.kill(old_pid, signal.SIGKILL)
        assert wait_for(lambda: health(stack.address) == NOT_SERVING, timeout=RESTART_BACKOFF_S), \
            "the frontend stayed SERVING without its scheduler"
        # A request arriving now waits for the scheduler, as long as its deadline allows.
        with pytest.raises(grpc.RpcError) as expired:
            client.generate(build_request(prompt_token_ids=[1, 2, 3], request_id="expires", max_tokens=4),
                            timeout=0.5)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: health(stack.address) == SERVING, timeout=60)
        results = [future.result() for future in futures]

    assert midway, "no request was mid-stream when the scheduler died: the test shows nothing"
    assert stack.processes["scheduler_svc"].pid != old_pid and stack.supervisor.restarts == {"scheduler_svc": 1}
    for i, got in enumerate(results):
        assert_matches(got, expected[i], f"request {i}")
    # The new scheduler's first step told kvcache_svc to drop what the old one held.
    assert wait_for(lambda: kv_idle(stack), timeout=10), "the killed scheduler's blocks leaked"


def test_executor_killed_under_load_every_request_is_recomputed_unchanged(stack, reference):
    requests, max_tokens = prompts(100, seed=2), 32
    expected = greedy(reference, requests, max_tokens)
    before = scheduler_stats(stack)
    results, midway = load_with_a_kill(stack, "executor_svc", requests, max_tokens, "executor-kill")
    after = scheduler_stats(stack)
    assert midway, "no request was mid-stream when the executor died: the test shows nothing"
    for i, got in enumerate(results):
        assert_matches(got, expected[i], f"request {i}")
    # The step in flight was rolled back, and the running requests were recomputed on the new instance.
    assert after.num_failed_steps > before.num_failed_steps
    assert after.num_recomputed_tokens > before.num_recomputed_tokens
    assert wait_for(lambda: kv_idle(stack), timeout=10)


def test_prompts_cached_before_an_executor_restart_are_recomputed_not_reused(stack, reference):
    warm = prompts(6, seed=3)
    expected = greedy(reference, warm, 16)
    with GenerateClient(stack.address) as client:
        for i, prompt in enumerate(warm):
            assert_matches(stream(client, prompt, f"warm-{i}", 16), expected[i], f"warm {i}")
    assert kv_stats(stack).num_cached_evictable > 0, "nothing was cached: the test shows nothing"
    failed_before = scheduler_stats(stack).num_failed_steps
    old_pid = stack.processes["executor_svc"].pid
    os.kill(old_pid, signal.SIGKILL)
    assert wait_for(lambda: stack.processes["executor_svc"].pid != old_pid, timeout=30)
    wait_until_serving(stack.executor_address, timeout=60)
    # The new executor's KV is all zeros: a prefix served from the old index would change every output.
    with GenerateClient(stack.address) as client:
        for i, prompt in enumerate(warm):
            assert_matches(stream(client, prompt, f"again-{i}", 16), expected[i], f"again {i}")
    # The first step after the kill failed (the old instance was gone, or the new one refused a plan made
    # for the old): that is how the scheduler learned of the new epoch.
    assert scheduler_stats(stack).num_failed_steps > failed_before


def test_kvcache_killed_under_load_without_redis_requests_are_readmitted(stack, reference):
    requests, max_tokens = prompts(100, seed=4), 32
    expected = greedy(reference, requests, max_tokens)
    before = scheduler_stats(stack)
    results, midway = load_with_a_kill(stack, "kvcache_svc", requests, max_tokens, "kvcache-kill")
    after = scheduler_stats(stack)
    assert midway
    for i, got in enumerate(results):
        assert_matches(got, expected[i], f"request {i}")
    assert after.num_recomputed_tokens > before.num_recomputed_tokens  # the restarted pool knew none of them
    # No hot loop while it was down: a handful of retries, not thousands.
    planned = (after.kv_rpcs - before.kv_rpcs) + (after.kv_calls_skipped - before.kv_calls_skipped)
    failed_calls = planned - (after.executor_rpcs - before.executor_rpcs)
    assert failed_calls < 40, f"{failed_calls} calls to a dead KV-cache service"
    assert wait_for(lambda: kv_idle(stack), timeout=10)


def test_kvcache_killed_with_redis_resumes_its_saved_state(model, reference, redis_server):
    requests, max_tokens = prompts(60, seed=5), 32
    expected = greedy(reference, requests, max_tokens)
    config = PagedServeConfig.from_kwargs(
        model=model, device="cpu", port=0, log_level="WARNING", kv_cache_memory=64 << 20,
        redis_url=redis_server.url, restart_backoff=1.0, max_restarts=2,
    )
    with Stack(config) as stack:
        results, midway = load_with_a_kill(stack, "kvcache_svc", requests, max_tokens, "durable")
        stats = scheduler_stats(stack)
        assert wait_for(lambda: kv_idle(stack), timeout=10)
    assert midway
    for i, got in enumerate(results):
        assert_matches(got, expected[i], f"request {i}")
    # The restarted service took over the saved pool: nobody had to be recomputed.
    assert stats.num_recomputed_tokens == 0 and stats.num_preemptions == 0


def test_frontend_killed_clients_get_unavailable_and_a_retry_runs_once(stack, reference):
    requests = prompts(16, seed=1)
    # Long enough to be mid-stream when the frontend dies, and for the requests to still be running a
    # second later unless they were aborted.
    max_tokens = 400
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    expected = reference.generate(requests, params)

    def request(i: int):
        return build_request(prompt_token_ids=requests[i], request_id=f"retry-{i}", temperature=0.0,
                             max_tokens=max_tokens, ignore_eos=True, logprobs=1)

    started = threading.Barrier(len(requests) + 1)
    codes: dict[int, grpc.StatusCode | None] = {}

    def first_try(client: GenerateClient, i: int) -> None:
        codes[i] = None
        first = True
        try:
            for _ in client.stream(request(i), timeout=120):
                if first:
                    started.wait()
                    first = False
        except grpc.RpcError as error:
            codes[i] = error.code()

    old_pid = stack.processes["frontend"].pid
    with GenerateClient(stack.address) as client:
        threads = [threading.Thread(target=first_try, args=(client, i)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        started.wait(timeout=60)  # every stream has its first token
        os.kill(old_pid, signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=60)
    assert codes == {i: grpc.StatusCode.UNAVAILABLE for i in range(len(requests))}
    # The scheduler aborted the dead frontend's requests: nothing of theirs runs on.
    assert wait_for(lambda: scheduler_load(stack) == 0, timeout=1), "the dead frontend's requests kept running"

    wait_until_serving(stack.address, timeout=60)
    assert stack.processes["frontend"].pid != old_pid
    with GenerateClient(stack.address) as client, ThreadPoolExecutor(len(requests)) as pool:
        def retry(i: int) -> tuple[list[int], list[float]]:
            tokens, logprobs = [], []
            for response in client.stream(request(i), timeout=120):
                tokens.extend(response.token_ids)
                logprobs.extend(entry.logprob for entry in response.logprobs)
            return tokens, logprobs

        results = list(pool.map(retry, range(len(requests))))
    for i, got in enumerate(results):
        assert_matches(got, expected[i], f"retry {i}")
    assert scheduler_load(stack) == 0
