"""Prefix caching through the full stack: TTFT of requests that share a long prefix, warm vs cold.

Every request is a shared prefix (default 1024 random token ids) plus its own suffix (32 tokens), sent one
at a time through the public gRPC API. Cold requests carry a cache salt of their own, so nothing they
send is in the cache; warm requests share one salt, after one request has computed the prefix. Writes
bench/results/prefix.json with warm_vs_cold_ttft (median warm TTFT / median cold TTFT) and the hit rate.

    python bench/prefix.py [--prefix-len 1024] [--suffix-len 32] [--num-requests 8]
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
from pagedserve.launcher import Stack, StackConfig  # noqa: E402
from pagedserve.service import channel  # noqa: E402
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc  # noqa: E402


def ttft(client: GenerateClient, prompt: list[int], salt: str, output_len: int) -> float:
    request = build_request(prompt_token_ids=prompt, temperature=0.0, max_tokens=output_len,
                            ignore_eos=True, cache_salt=salt)
    start = time.perf_counter()
    first = None
    for response in client.stream(request):
        if first is None and response.token_ids:
            first = time.perf_counter() - start
    return first


def kv_stats(address: str) -> kvcache_pb2.KVCacheStats:
    with channel(address) as ch:
        return kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.KVCacheStatsRequest())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="prefix")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    vocab = 49152
    prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)]
    suffixes = [[rng.randrange(vocab) for _ in range(args.suffix_len)] for _ in range(args.num_requests + 1)]
    run_tag = f"{time.time_ns()}"  # a fresh salt space, so that an earlier run's cache cannot help

    config = StackConfig(model=args.model, dtype=args.dtype, port=0, kv_cache_memory=args.kv_cache_memory)
    with Stack(config) as stack, GenerateClient(stack.address) as client:
        ttft(client, suffixes[0][:8], f"{run_tag}-warmup", 1)
        cold, warm = [], []
        # Interleaved, so that drift on a shared machine hits both sides alike.
        ttft(client, prefix + suffixes[0], f"{run_tag}-warm", args.output_len)  # computes the shared prefix
        before = kv_stats(stack.kvcache_address)
        for i in range(1, args.num_requests + 1):
            cold.append(ttft(client, prefix + suffixes[i], f"{run_tag}-cold-{i}", args.output_len))
            warm.append(ttft(client, prefix + suffixes[i], f"{run_tag}-warm", args.output_len))
        after = kv_stats(stack.kvcache_address)

    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    ratio = statistics.median(warm) / statistics.median(cold)
    print(f"TTFT cold median {statistics.median(cold) * 1e3:.1f} ms, warm median {statistics.median(warm) * 1e3:.1f} ms, "
          f"warm_vs_cold_ttft {ratio:.3f}, hit rate {hits / queries:.3f}")
    path = write_result(args.name, {"warm_vs_cold_ttft": ratio}, {
        "workload": {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "output_len": args.output_len,
                     "num_requests": args.num_requests, "model": args.model, "dtype": args.dtype},
        "ttft_cold_ms": [t * 1e3 for t in cold],
        "ttft_warm_ms": [t * 1e3 for t in warm],
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "hit_rate": hits / queries,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
