"""CPU paged attention: the C++ kernels (reading K/V through the block tables in place) vs the torch backend
(gathering each request's blocks into a dense copy, then matmuls), side by side in one run, both including
the step's cache write. SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), blocks of
16 tokens on a shuffled pool in huge pages, as the executor allocates it. Writes bench/results/attention.json;
`paged_vs_gather` is the worse of the two cases' time ratios (kernel / gather path).

    python bench/attention.py [--dtype float32] [--repeats 20] [--isa auto] [--window N]

With --window, both sides attend through a sliding window of N keys (Mistral, Gemma's local layers): the
kernels read only the window, the gather path still gathers every block and masks.

Each case also reports the kernel's arithmetic rate: the multiply-adds of the scores and outputs a causal
(windowed) attention needs, per second, beside the rate of MKL's own batched product of the gather path's shape
(the queries against every key, per head) in the same run. `ratio_at_gemm_rate` is the time ratio the kernel
would reach computing at MKL's rate: the floor of prefill's ratio, which is bound by arithmetic, not memory.

To see an AVX2-only machine on a wider one, restrict both sides: `--isa avx2` for the kernels and
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 for torch.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from executor_svc.attention.cpu_backend import CpuPagedAttention, load_extension  # noqa: E402
from executor_svc.attention.layout import BatchLayout  # noqa: E402
from executor_svc.attention.torch_backend import TorchPagedAttention  # noqa: E402
from executor_svc.kv_cache import huge_page_zeros  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_case(query_lens: list[int], context_lens: list[int], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-c // BLOCK_SIZE) for c in context_lens]
    pool = torch.randperm(sum(needed), generator=gen).tolist()
    tables, taken = [], 0
    for n in needed:
        tables.append(pool[taken : taken + n])
        taken += n
    shape = (sum(needed), NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    # K and V in one pool on huge pages, as the executor allocates its KV cache (executor_svc/kv_cache.py).
    numel = math.prod(shape)
    pool_memory = huge_page_zeros(2 * numel * dtype.itemsize).view(dtype)
    caches = tuple(pool_memory[i * numel:(i + 1) * numel].view(shape).copy_(torch.randn(shape, generator=gen))
                   for i in range(2))
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for n, c, t in zip(query_lens, context_lens, tables) for p in range(c - n, c)]
    qkv = torch.randn(len(slots), (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    layout = BatchLayout(query_lens=query_lens, context_lens=context_lens, block_tables=tables,
                         num_prefills=sum(n > 1 for n in query_lens), slot_mapping=torch.tensor(slots),
                         block_size=BLOCK_SIZE)
    return layout, (q, k, v), caches


def attention_flops(layout: BatchLayout, window: int | None) -> int:
    """Floating-point operations of the attention itself: two multiply-adds per head dimension, for the score
    and for the output, of every (query head, key it sees) pair."""
    pairs = 0
    for n, context in zip(layout.query_lens, layout.context_lens):
        for position in range(context - n, context):
            pairs += min(position + 1, window or position + 1)
    return pairs * NUM_HEADS * 4 * HEAD_DIM


def gemm_flops_per_s(tokens: int, keys: int, dtype: torch.dtype, repeats: int) -> float:
    """MKL's rate on the gather path's products, per head: queries [tokens, D] against keys [D, keys], then the
    weights [tokens, keys] against the values [keys, D]; the best of `repeats`."""
    gen = torch.Generator().manual_seed(0)
    q, v = (torch.randn(NUM_HEADS, n, HEAD_DIM, generator=gen).to(dtype) for n in (tokens, keys))
    k_t = torch.randn(NUM_HEADS, HEAD_DIM, keys, generator=gen).to(dtype)
    scores = torch.bmm(q, k_t)
    best = math.inf
    for _ in range(repeats + 1):
        start = time.perf_counter()
        torch.bmm(q, k_t, out=scores)
        torch.bmm(scores, v)
        best = min(best, time.perf_counter() - start)
    return NUM_HEADS * 4 * tokens * keys * HEAD_DIM / best


def time_backends(layout, qkv, caches, repeats: int, window: int | None = None) -> dict:
    """Median seconds per forward of each backend, runs interleaved so that load drifts hit both alike."""
    backends = {"paged": CpuPagedAttention, "gather": TorchPagedAttention}
    runs = {}
    for name, cls in backends.items():
        backend = cls(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
        runs[name] = (backend, backend.build_metadata(layout, torch.device("cpu")))
    outputs = {name: backend.forward(*qkv, *caches, meta, window) for name, (backend, meta) in runs.items()}  # warm-up
    error = ((outputs["paged"].double() - outputs["gather"].double()).norm() / outputs["gather"].double().norm()).item()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (backend, meta) in runs.items():
            start = time.perf_counter()
            backend.forward(*qkv, *caches, meta, window)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"paged_s": medians["paged"], "gather_s": medians["gather"],
            "ratio": medians["paged"] / medians["gather"], "relative_difference": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    parser.add_argument("--isa", default="auto", choices=["auto", "avx512_bf16", "avx512", "avx2", "baseline"],
                        help="the kernels' instruction-set path")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prefill-cached", type=int, default=1024)
    parser.add_argument("--window", type=int, default=None, help="a sliding window of this many keys")
    parser.add_argument("--name", default="attention", help="result file name under bench/results/")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    load_extension().select_isa(args.isa)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = {
        "decode": make_case([1] * args.decode_batch, [args.decode_context] * args.decode_batch, dtype),
        "prefill": make_case([args.prefill_tokens], [args.prefill_cached + args.prefill_tokens], dtype),
    }
    metrics = {"shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                         "block_size": BLOCK_SIZE, "dtype": args.dtype, "isa": CpuPagedAttention.isa(),
                         "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                         "torch_threads": torch.get_num_threads(), "window": args.window},
               "cases": {"decode": {"batch": args.decode_batch, "context": args.decode_context},
                         "prefill": {"tokens": args.prefill_tokens, "cached": args.prefill_cached}}}
    ratios = {}
    for name, case in cases.items():
        result = time_backends(*case, args.repeats, args.window)
        layout = case[0]
        flops = attention_flops(layout, args.window)
        gemm_rate = gemm_flops_per_s(max(layout.query_lens) if name == "prefill" else 1, max(layout.context_lens),
                                     dtype, args.repeats)
        result.update(gflop=flops / 1e9, paged_gflop_per_s=flops / result["paged_s"] / 1e9,
                      gemm_gflop_per_s=gemm_rate / 1e9, ratio_at_gemm_rate=flops / gemm_rate / result["gather_s"])
        metrics["cases"][name].update(result)
        ratios[f"paged_vs_gather_{name}"] = result["ratio"]
        print(f"{name}: kernel {result['paged_s'] * 1e3:.2f} ms, gather path {result['gather_s'] * 1e3:.2f} ms, "
              f"ratio {result['ratio']:.3f}; kernel {result['paged_gflop_per_s']:.0f} GFLOP/s, MKL's products of "
              f"the gather path's shape {result['gemm_gflop_per_s']:.0f} (ratio at that rate "
              f"{result['ratio_at_gemm_rate']:.3f})", flush=True)
    ratios["paged_vs_gather"] = max(ratios["paged_vs_gather_decode"], ratios["paged_vs_gather_prefill"])
    print(f"wrote {write_result(args.name, ratios, metrics)}")


if __name__ == "__main__":
    main()
