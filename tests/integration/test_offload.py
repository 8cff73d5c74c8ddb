"""The offload tier: evicted prefix blocks come back from host memory or Redis instead of being recomputed."""
from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams

BLOCK = 16
# Logprobs make the comparison sensitive: a tiny random model's greedy tokens barely depend on context.
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 150) for _ in range(n)]


PREFIX = tokens(0, 3 * BLOCK)  # three full blocks
FIRST, SECOND = PREFIX + tokens(1, 5), PREFIX + tokens(2, 5)
FILLERS = [tokens(10 + i, 150) for i in range(2)]  # each one nearly fills the pool


def small_llm(model_dir, **kwargs) -> LLM:
    # A pool of 12 blocks: the fillers must evict the prefix.
    probe = LLM(str(model_dir), device="cpu", kv_cache_memory=1 << 20, block_size=BLOCK, offload="none")
    block_bytes = probe.runner.block_bytes
    return LLM(str(model_dir), device="cpu", kv_cache_memory=12 * block_bytes, block_size=BLOCK, **kwargs)


@pytest.fixture(scope="module")
def cold_output(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=1 << 20, block_size=BLOCK,
              enable_prefix_caching=False)
    return fingerprint(llm.generate([SECOND], PARAMS)[0])


def fingerprint(result) -> tuple[list[int], list[float]]:
    return result.token_ids, [round(entry.logprob, 4) for entry in result.logprobs]


def evict_prefix(llm: LLM) -> None:
    llm.generate([FIRST], PARAMS)
    for filler in FILLERS:
        llm.generate([filler], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert llm.block_manager.block_pool.num_evictions >= 3


@pytest.mark.parametrize("tier", ["host", "redis"])
def test_evicted_prefix_is_loaded_from_the_tier_not_recomputed(tiny_llama_dir, cold_output, tier, request):
    redis_url = request.getfixturevalue("redis_server").url if tier == "redis" else None
    llm = small_llm(tiny_llama_dir, offload=tier, redis_url=redis_url)
    evict_prefix(llm)
    computed_before = llm.runner.num_prefill_tokens
    [result] = llm.generate([SECOND], PARAMS)
    assert fingerprint(result) == cold_output
    assert llm.runner.blocks_loaded == 3 and llm.runner.failed_loads == 0
    assert llm.block_manager.tier_hits == 3 * BLOCK
    stats = llm.block_manager.stats()
    assert stats["bytes_moved"] == (stats["blocks_saved"] + 3) * llm.runner.block_bytes
    assert llm.runner.bytes_loaded == 3 * llm.runner.block_bytes
    assert llm.runner.num_prefill_tokens - computed_before == 5  # only the suffix was prefilled
    if tier == "redis":
        keys = request.getfixturevalue("redis_server").client.keys("pagedserve:kv:v1:*")
        assert len(keys) >= 3


def test_a_fresh_engine_finds_blocks_another_wrote_to_redis(tiny_llama_dir, cold_output, redis_server):
    writer = small_llm(tiny_llama_dir, redis_url=redis_server.url, offload_all=True)
    writer.generate([FIRST], PARAMS)  # write-through: its full blocks go to Redis as they fill
    reader = small_llm(tiny_llama_dir, redis_url=redis_server.url)  # an empty pool, as after a restart
    [result] = reader.generate([SECOND], PARAMS)
    assert fingerprint(result) == cold_output
    assert reader.runner.blocks_loaded == 3
    assert reader.block_manager.tier_hits == 3 * BLOCK


def test_blocks_missing_from_the_tier_are_recomputed(tiny_llama_dir, cold_output):
    llm = small_llm(tiny_llama_dir, offload="host")
    evict_prefix(llm)
    llm.runner.offload_tier.blocks.clear()  # the tier lost them; the block manager's index did not
    [result] = llm.generate([SECOND], PARAMS)
    assert fingerprint(result) == cold_output
    assert llm.runner.failed_loads == 3 and llm.runner.blocks_loaded == 0


def test_redis_stopped_mid_run_fails_no_request(tiny_llama_dir, cold_output, redis_server):
    llm = small_llm(tiny_llama_dir, redis_url=redis_server.url)
    llm.generate([FIRST], PARAMS)
    redis_server.stop()
    evict_prefix(llm)  # saves now fail
    [result] = llm.generate([SECOND], PARAMS)  # lookups fail too
    assert fingerprint(result) == cold_output
    assert llm.runner.offload_tier.errors > 0 and llm.runner.offload_tier.disabled
