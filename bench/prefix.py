"""Prefix caching through the full stack: TTFT of requests that share a long prefix, cold, warm, and
with the prefix loaded back from Redis.

Each of several prefixes (default 1024 random token ids) is sent with suffixes of its own (32 tokens), one
request at a time through the public gRPC API, to a stack whose executor writes every block through to a
private Redis:
- cold: the prefix's first request computes everything;
- warm: its second request finds the prefix in the KV pool;
- redis: a fresh stack (an empty pool, as after a restart) on the same Redis loads it from there.
Writes bench/results/prefix.json with warm_vs_cold_ttft and redis_vs_recompute_ttft (medians), and the
hit rates.

    python bench/prefix.py [--prefix-len 1024] [--suffix-len 32] [--num-prefixes 6]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from pagedserve.client import GenerateClient, build_request  # noqa: E402
from pagedserve.config import PagedServeConfig  # noqa: E402
from pagedserve.entrypoints.launcher import Stack  # noqa: E402
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc  # noqa: E402
from tests.support.local_redis import LocalRedis  # noqa: E402


def ttft(client: GenerateClient, prompt: list[int], salt: str, output_len: int) -> float:
    request = build_request(prompt_token_ids=prompt, temperature=0.0, max_tokens=output_len,
                            ignore_eos=True, cache_salt=salt)
    start = time.perf_counter()
    first = None
    for response in client.stream(request):
        if first is None and response.token_ids:
            first = time.perf_counter() - start
    return first


def kv_stats(stack) -> kvcache_pb2.KVCacheStats:
    with stack.channel("kvcache_svc") as ch:
        return kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.KVCacheStatsRequest())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--num-prefixes", type=int, default=6)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="prefix")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    vocab = 49152
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]

    def prompt(i: int) -> list[int]:
        return prefixes[i] + [rng.randrange(vocab) for _ in range(args.suffix_len)]

    salt = f"bench-{time.time_ns()}"  # a fresh salt space: nothing from an earlier run can help
    cold, warm, from_redis = [], [], []
    with LocalRedis() as redis_server:
        config = PagedServeConfig.from_kwargs(model=args.model, device="cpu", dtype=args.dtype, port=0,
                                              kv_cache_memory=args.kv_cache_memory, redis_url=redis_server.url,
                                              offload_all=True)
        with Stack(config) as stack, GenerateClient(stack.address) as client:
            ttft(client, [1, 2, 3, 4], f"{salt}-warmup", 1)
            before = kv_stats(stack)
            for i in range(args.num_prefixes):
                cold.append(ttft(client, prompt(i), salt, args.output_len))
                warm.append(ttft(client, prompt(i), salt, args.output_len))
            pool = kv_stats(stack)
        with Stack(config) as stack, GenerateClient(stack.address) as client:
            ttft(client, [1, 2, 3, 4], f"{salt}-warmup", 1)
            for i in range(args.num_prefixes):
                from_redis.append(ttft(client, prompt(i), salt, args.output_len))
            tier = kv_stats(stack)
        redis_keys = len(redis_server.client.keys("pagedserve:kv:v1:*"))

    warm_ratio = statistics.median(warm) / statistics.median(cold)
    redis_ratio = statistics.median(from_redis) / statistics.median(cold)
    pool_hit_rate = (pool.prefix_cache_hits - before.prefix_cache_hits) / (
        pool.prefix_cache_queries - before.prefix_cache_queries)
    tier_hit_rate = tier.tier_hits / tier.prefix_cache_queries
    ms = lambda values: [round(v * 1e3, 1) for v in values]  # noqa: E731
    print(f"TTFT median: cold {statistics.median(cold) * 1e3:.0f} ms, warm {statistics.median(warm) * 1e3:.0f} ms, "
          f"from Redis {statistics.median(from_redis) * 1e3:.0f} ms")
    print(f"warm_vs_cold_ttft {warm_ratio:.3f}, redis_vs_recompute_ttft {redis_ratio:.3f}; "
          f"hit rate {pool_hit_rate:.3f} (pool, cold + warm requests), {tier_hit_rate:.3f} (tier, fresh stack)")
    path = write_result(args.name, {"warm_vs_cold_ttft": warm_ratio, "redis_vs_recompute_ttft": redis_ratio}, {
        "workload": {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "output_len": args.output_len,
                     "num_prefixes": args.num_prefixes, "model": args.model, "dtype": args.dtype},
        "ttft_cold_ms": ms(cold),
        "ttft_warm_ms": ms(warm),
        "ttft_from_redis_ms": ms(from_redis),
        "pool_hit_rate": pool_hit_rate,
        "tier_hit_rate": tier_hit_rate,
        "tier_hit_tokens": tier.tier_hits,
        "redis_keys": redis_keys,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
