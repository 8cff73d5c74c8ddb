"""KV-aware routing against round-robin: two executors (`pagedserve up --executors 2`), 8 prefixes x 8
suffixes in a shuffled order, a few requests at a time; the prefix hit rate (prompt tokens found cached
where the request was admitted, over all prompt tokens; the KV-cache service's counters summed over the
executors) with `--routing kv` over that with `--routing round_robin`, same run, same requests.

Each executor's pool holds about half the prefixes (--pool-blocks; no offload tier, so that a hit is a hit
in the pool): routed by their prefix, the requests of a prefix find it where they land, and each executor
keeps the half it was given; in turn, each executor sees every prefix, and they push each other out. Greedy
outputs of the two runs are compared too. Writes bench/results/routing.json.

    python bench/routing.py [--prefix-blocks 6] [--suffix-len 8] [--pool-blocks 32] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from pagedserve.client import GenerateClient, build_request  # noqa: E402
from pagedserve.config import PagedServeConfig  # noqa: E402
from pagedserve.entrypoints.launcher import Stack  # noqa: E402
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc  # noqa: E402

BLOCK_SIZE = 16
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def block_bytes(model: str, dtype: str) -> int:
    """One block's K and V over all layers, from the model's config."""
    from executor_svc.model_loader import resolve_model_dir

    config = json.loads((resolve_model_dir(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype] * BLOCK_SIZE


def kv_stats(stack) -> kvcache_pb2.KVCacheStats:
    with stack.channel("kvcache_svc") as ch:
        return kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.KVCacheStatsRequest(), timeout=10)


def run(args, routing: str, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    config = PagedServeConfig.from_kwargs(
        model=args.model, device="cpu", dtype=args.dtype, port=0, log_level="WARNING", executors=2,
        routing=routing, offload="none", block_size=BLOCK_SIZE,
        kv_cache_memory=args.pool_blocks * block_bytes(args.model, args.dtype))

    def generate(client: GenerateClient, prompt: list[int]) -> list[int]:
        tokens = []
        for response in client.stream(build_request(prompt_token_ids=prompt, temperature=0.0,
                                                    max_tokens=args.output_len, ignore_eos=True), timeout=600):
            tokens.extend(response.token_ids)
        return tokens

    with Stack(config) as stack, GenerateClient(stack.address) as client:
        generate(client, [1, 2, 3])  # warm-up: both executors serve before the count starts
        before = kv_stats(stack)
        with ThreadPoolExecutor(args.concurrency) as pool:
            outputs = list(pool.map(lambda p: generate(client, p), prompts))
        after = kv_stats(stack)
    per_executor = {
        address: {"prefix_cache_queries": s.prefix_cache_queries - before.executors[address].prefix_cache_queries,
                  "prefix_cache_hits": s.prefix_cache_hits - before.executors[address].prefix_cache_hits,
                  "evictions": s.evictions - before.executors[address].evictions}
        for address, s in after.executors.items()
    }
    queries = sum(e["prefix_cache_queries"] for e in per_executor.values())
    hits = sum(e["prefix_cache_hits"] for e in per_executor.values())
    return {"hit_rate": round(hits / queries, 4), "prefix_cache_hits": hits, "prefix_cache_queries": queries,
            "executors": per_executor}, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--num-suffixes", type=int, default=8)
    parser.add_argument("--prefix-blocks", type=int, default=6)
    parser.add_argument("--suffix-len", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=2)
    parser.add_argument("--pool-blocks", type=int, default=32, help="blocks of each executor's pool")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    vocab = 49152
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_blocks * BLOCK_SIZE)]
                for _ in range(args.num_prefixes)]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(args.suffix_len)]
               for prefix in prefixes for _ in range(args.num_suffixes)]
    rng.shuffle(prompts)
    kv, kv_outputs = run(args, "kv", prompts)
    round_robin, rr_outputs = run(args, "round_robin", prompts)
    metrics = {"requests": len(prompts), "prefix_tokens": args.prefix_blocks * BLOCK_SIZE,
               "suffix_tokens": args.suffix_len, "pool_blocks_per_executor": args.pool_blocks,
               "concurrency": args.concurrency, "kv": kv, "round_robin": round_robin,
               "greedy_outputs_equal": kv_outputs == rr_outputs}
    ratio = kv["hit_rate"] / round_robin["hit_rate"] if round_robin["hit_rate"] else float("inf")
    path = write_result("routing", {"kv_routing_vs_round_robin_hit_rate": round(ratio, 3)}, metrics)
    print(path.read_text())


if __name__ == "__main__":
    main()
