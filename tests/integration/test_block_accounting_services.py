"""Block accounting through the real services: shared prefixes, several salts and cancels on a pool a
quarter of what the load needs, driven through the public gRPC API. Outputs equal an unconstrained
in-process run, preemptions (by swap) happen and are counted alike by the scheduler and the KV-cache
service, and every block and every swapped copy comes back."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig
from pagedserve.entrypoints.launcher import Stack
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

BLOCK_SIZE = 16
MAX_TOKENS = 24
SALTS = [None, "tenant-a", "tenant-b"]


def workload(seed: int = 0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 150) for _ in range(3 * BLOCK_SIZE)] for _ in range(3)]
    return [
        (prefixes[i % 3][: rng.randint(1, 3) * BLOCK_SIZE] + [rng.randrange(1, 150) for _ in range(rng.randint(1, 20))],
         SALTS[(i // 3) % len(SALTS)])
        for i in range(24)
    ]


def test_quarter_pool_with_shared_prefixes_salts_and_cancels(tiny_model_with_tokenizer):
    requests = workload()
    # Logprobs make the comparison sensitive: a tiny random model's greedy tokens barely depend on context.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    reference = LLM(str(tiny_model_with_tokenizer), device="cpu", dtype="float32", kv_cache_memory=64 << 20)
    expected = [reference.generate([prompt], params, cache_salt=salt)[0] for prompt, salt in requests]

    needed_blocks = sum(-(-(len(prompt) + MAX_TOKENS) // BLOCK_SIZE) for prompt, _ in requests)
    bytes_per_block = reference.runner.config.kv_bytes_per_token(torch.float32) * BLOCK_SIZE
    config = PagedServeConfig.from_kwargs(
        model=str(tiny_model_with_tokenizer), device="cpu", dtype="float32", port=0, log_level="WARNING",
        kv_cache_memory=(needed_blocks // 4) * bytes_per_block, max_num_batched_tokens=128,
        preemption_mode="swap",
    )
    cancelled = {5, 13}
    results: dict[int, tuple[list[int], list[float], str | None]] = {}
    errors: list[BaseException] = []
    with Stack(config) as stack, GenerateClient(stack.address) as client:
        def run(i: int) -> None:
            prompt, salt = requests[i]
            tokens, logprobs, finish = [], [], None
            try:
                stream = client.stream(build_request(
                    prompt_token_ids=prompt, cache_salt=salt or "", temperature=0.0, max_tokens=MAX_TOKENS,
                    ignore_eos=True, logprobs=1,
                ))
                for response in stream:
                    tokens.extend(response.token_ids)
                    logprobs.extend(entry.logprob for entry in response.logprobs)
                    finish = response.finish_reason or finish
                    if i in cancelled and len(tokens) >= 4:
                        stream.cancel()
                        break
            except BaseException as error:  # reported below, with the request that failed
                errors.append(error)
            results[i] = tokens, logprobs, finish

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        with stack.channel("kvcache_svc") as ch:
            kv = kvcache_pb2_grpc.KVCacheStub(ch)
            # Cancelled requests' blocks return with the next step, which the idle scheduler still runs.
            for _ in range(100):
                pool = kv.GetStats(kvcache_pb2.KVCacheStatsRequest())
                if pool.num_requests == 0:
                    break
                threading.Event().wait(0.05)
        with stack.channel("scheduler_svc") as ch:
            scheduler = scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.SchedulerStatsRequest())

    assert not errors, errors
    for i, (tokens, logprobs, _finish) in results.items():
        want = expected[i]
        if i in cancelled:
            assert tokens == want.token_ids[: len(tokens)], f"request {i}"
            continue
        assert tokens == want.token_ids, f"request {i}"
        assert logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4), f"request {i}"
    assert pool.num_preemptions > 0, "the quarter pool never ran short: the test shows nothing"
    assert scheduler.num_preemptions == pool.num_preemptions
    # Preempted by swap through the services: copied out, loaded back, and nothing left in host memory. A request
    # preempted before any of its KV was confirmed computed (its first chunk still in flight) has nothing to copy
    # and is recomputed, so not every preemption is a swap.
    assert 0 < pool.num_swaps <= pool.num_preemptions
    assert pool.blocks_swapped_in > 0 and pool.swap_blocks_in_use == 0
    assert pool.prefix_cache_hits > 0
    assert (pool.num_requests, pool.num_in_use, pool.num_free_blocks) == (0, 0, pool.num_blocks)
