"""Several executors (`pagedserve up --executors 2`): each registers with the KV-cache service, which keeps a
pool per executor and admits a new request on the executor holding the longest cached prefix of it; the
scheduler sends each step's parts to the executors at once. A tiny random Llama on the CPU; greedy outputs
are compared with the offline LLM's (one executor)."""
from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig
from pagedserve.entrypoints.launcher import Stack
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support.probes import wait_for
from tests.support.tiny_stack import kv_stats, wait_until_idle

BLOCK_SIZE = 16
PREFIX_BLOCKS = 3
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(model):
    config = PagedServeConfig.from_kwargs(model=model, device="cpu", port=0, log_level="WARNING",
                                          kv_cache_memory=64 << 20, executors=2, restart_backoff=0.5)
    with Stack(config) as running:
        assert wait_for(lambda: len(registered(running)) == 2, timeout=30), "the executors did not register"
        yield running


def registered(stack) -> dict[str, str]:
    """{address: epoch} of the executors registered with the KV-cache service."""
    with stack.channel("kvcache_svc") as ch:
        answer = kvcache_pb2_grpc.KVCacheStub(ch).ListExecutors(kvcache_pb2.ListExecutorsRequest(), timeout=5)
    return {e.address: e.epoch for e in answer.executors}


def greedy(reference: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    results = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [r.token_ids for r in results]


def run_all(stack, prompts: list[list[int]], tag: str, parallel: int = 16,
            max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    def run(client: GenerateClient, i: int) -> list[int]:
        tokens = []
        for response in client.stream(build_request(prompt_token_ids=prompts[i], request_id=f"{tag}-{i}",
                                                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                      timeout=120):
            tokens.extend(response.token_ids)
        return tokens

    with GenerateClient(stack.address) as client, ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda i: run(client, i), range(len(prompts))))


def prefixed_prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """8 prefixes of 3 blocks: the first request of each, and the 7 others x 8, shuffled."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 150) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)] for _ in range(8)]
    suffixes = [[rng.randrange(1, 150) for _ in range(8)] for _ in range(8)]
    first = [prefix + suffixes[0] for prefix in prefixes]
    rest = [prefix + suffix for prefix in prefixes for suffix in suffixes[1:]]
    rng.shuffle(rest)
    return first, rest


def test_requests_sharing_a_prefix_land_on_the_executor_that_holds_it(stack, reference):
    first, rest = prefixed_prompts(seed=1)
    before = kv_stats(stack)
    assert set(before.executors) == set(registered(stack))
    got_first = run_all(stack, first, "first")
    got_rest = run_all(stack, rest, "rest")
    assert got_first == greedy(reference, first)
    assert got_rest == greedy(reference, rest)
    after = wait_until_idle(stack)
    hits = {a: after.executors[a].prefix_cache_hits - before.executors[a].prefix_cache_hits for a in after.executors}
    queries = {a: after.executors[a].prefix_cache_queries - before.executors[a].prefix_cache_queries
               for a in after.executors}
    # Both executors served, and every request after the first of its prefix found the whole prefix cached
    # where it was admitted: it was sent to the executor that held it.
    assert all(queries.values()), queries
    assert sum(hits.values()) == len(rest) * PREFIX_BLOCKS * BLOCK_SIZE, hits
    assert sum(s.num_requests for s in after.executors.values()) == 0


def scheduler_stats(stack) -> scheduler_pb2.SchedulerStats:
    with stack.channel("scheduler_svc") as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)


def test_an_executor_killed_under_load_every_request_completes_unchanged(stack, reference):
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 150) for _ in range(rng.randint(4, 60))] for _ in range(32)]
    max_tokens = 32
    expected = greedy(reference, prompts, max_tokens)
    before = scheduler_stats(stack)
    victim = "executor_svc-1"
    old_pid, old_epochs = stack.processes[victim].pid, registered(stack)
    with ThreadPoolExecutor(1) as killer:
        def kill_when_busy() -> None:
            wait_for(lambda: kv_stats(stack).executors[stack.addresses[victim]].num_requests > 0, timeout=60)
            os.kill(old_pid, signal.SIGKILL)

        kill = killer.submit(kill_when_busy)
        got = run_all(stack, prompts, "kill", parallel=32, max_tokens=max_tokens)
        kill.result()
    assert got == expected
    # The steps out when it died were rolled back, and their requests recomputed (on the other executor, or
    # the restarted one).
    after = scheduler_stats(stack)
    assert after.num_failed_steps > before.num_failed_steps
    assert after.num_recomputed_tokens > before.num_recomputed_tokens
    # (The requests may all have finished on the other executor before the restart's back-off ran out.)
    assert wait_for(lambda: stack.processes[victim].pid != old_pid, timeout=30), "the executor was not restarted"
    # The restarted executor registered again, under a new epoch, and takes new work.
    assert wait_for(lambda: registered(stack).get(stack.addresses[victim], old_epochs[stack.addresses[victim]])
                    != old_epochs[stack.addresses[victim]], timeout=60)
    more = [[rng.randrange(1, 150) for _ in range(20)] for _ in range(8)]
    before = kv_stats(stack).executors[stack.addresses[victim]].prefix_cache_queries
    assert run_all(stack, more, "after") == greedy(reference, more)
    assert kv_stats(stack).executors[stack.addresses[victim]].prefix_cache_queries > before


def test_kvcache_killed_with_redis_restores_every_executors_pool(model, reference, redis_server):
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 150) for _ in range(rng.randint(4, 60))] for _ in range(32)]
    max_tokens = 32
    expected = greedy(reference, prompts, max_tokens)
    config = PagedServeConfig.from_kwargs(model=model, device="cpu", port=0, log_level="WARNING",
                                          kv_cache_memory=64 << 20, executors=2, redis_url=redis_server.url,
                                          restart_backoff=0.5, max_restarts=2)
    with Stack(config) as stack:
        assert wait_for(lambda: len(registered(stack)) == 2, timeout=30)
        old_pid = stack.processes["kvcache_svc"].pid
        with ThreadPoolExecutor(1) as killer:
            def kill_when_both_busy() -> None:
                wait_for(lambda: all(s.num_requests for s in kv_stats(stack).executors.values()), timeout=60)
                os.kill(old_pid, signal.SIGKILL)

            kill = killer.submit(kill_when_both_busy)
            got = run_all(stack, prompts, "durable", parallel=32, max_tokens=max_tokens)
            kill.result()
        stats = scheduler_stats(stack)
        assert stack.processes["kvcache_svc"].pid != old_pid, "the KV-cache service was not restarted"
        assert wait_for(lambda: len(registered(stack)) == 2, timeout=30)
    assert got == expected
    # The restarted service took over both saved pools: nobody had to be recomputed.
    assert stats.num_recomputed_tokens == 0 and stats.num_preemptions == 0
