"""Attention kernel benchmark on one CUDA GPU: paged decode and prefill through the CuPy backend.

Decode (bf16, block size 16, one new token per sequence, every sequence at the same context length):
achieved bandwidth over the bytes that must move (the whole K/V context once, the query, the output and the
new K/V row), against a device-to-device copy measured in the same run (bytes read + written), and torch's
scaled_dot_product_attention on contiguous, non-paged K/V as a reference. Prefill: TFLOP/s of causal
attention over fresh prompts and over a chunk with cached context, SDPA (is_causal) on the fresh prompts.

Every timing replays a CUDA graph of several calls (launch gaps out of the picture; a captured forward is
also how a server would run decode), timed with CUDA events, median of several replays, after warm-up.
Inputs rotate among enough independent copies that the working set exceeds the L2 cache.
Writes RESULTS_DIR/kernel.json (bench/results by default); ratio decode_vs_copy_bw is taken at batch 64,
context 2048 on the Qwen2.5-0.5B-like shape (14 query heads, 2 KV heads, head_dim 64).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import write_result  # noqa: E402
from executor_svc.attention.cupy_backend import CupyPagedAttention, load_kernels  # noqa: E402
from executor_svc.attention.layout import BatchLayout  # noqa: E402

SHAPES = {"qwen2.5-0.5b-like": (14, 2, 64), "llama-3.2-1b-like": (32, 8, 64)}  # (heads, KV heads, head_dim)
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192)
HEADLINE = ("qwen2.5-0.5b-like", 64, 2048)
PREFILL_CASES = {  # name: (query lengths, cached lengths)
    "prompt 4096": ([4096], [0]),
    "8 prompts x 512": ([512] * 8, [0] * 8),
    "chunk 2048 over 6144 cached": ([2048], [6144]),
}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
ROTATE_BYTES = 512 << 20  # input copies per timing cover at least this much (an H200's L2 is 60 MB)
DEVICE = torch.device("cuda")


def time_per_call(fn, calls: int = 10, replays: int = 7) -> tuple[float, str]:
    """Seconds per fn(i) call: median over replays of a CUDA graph holding `calls` calls (eager if capture fails)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        run, mode = graph.replay, "cuda-graph"
    except Exception as exc:  # a capture failure is a finding to report, the measurement can still go on
        print(f"  graph capture failed ({type(exc).__name__}: {exc}); timing eager calls", flush=True)
        torch.cuda.synchronize()

        def run():
            for i in range(calls):
                fn(i)

        mode = "eager"
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times), mode


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, read plus write."""
    numel = (1 << 30) // 2
    src = torch.empty(numel, dtype=DTYPE, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    seconds, _ = time_per_call(lambda i: dst.copy_(src))
    del src, dst
    return 2 * numel * 2 / seconds


def paged_decode_inputs(backend, heads, kv_heads, head_dim, batch, context, sets):
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq * sets
    shape = (num_blocks, kv_heads, BLOCK_SIZE, head_dim)
    key_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    value_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
    qkv = torch.randn(sets, batch, (heads + 2 * kv_heads) * head_dim, dtype=DTYPE, device=DEVICE)
    tables = torch.randperm(num_blocks).view(sets, batch, blocks_per_seq).tolist()
    metas = []
    for s in range(sets):
        last = context - 1  # the new token's position
        slots = [t[last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE for t in tables[s]]
        layout = BatchLayout([1] * batch, [context] * batch, tables[s], 0,
                             torch.tensor(slots, dtype=torch.int64, device=DEVICE), BLOCK_SIZE)
        metas.append(backend.build_metadata(layout, DEVICE))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    views = [qkv[s].split([q_size, kv_size, kv_size], dim=-1) for s in range(sets)]
    return key_cache, value_cache, views, metas


def bench_decode(shape_name, batch, context) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape_name]
    backend = CupyPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * 2  # K and V, 2 bytes each
    must_move = kv_bytes + batch * heads * head_dim * 2 * 2 + batch * kv_heads * head_dim * 2 * 2
    sets = max(1, min(8, math.ceil(ROTATE_BYTES / kv_bytes)))
    key_cache, value_cache, views, metas = paged_decode_inputs(backend, heads, kv_heads, head_dim, batch, context, sets)

    def paged(i):
        q, k, v = views[i % sets]
        backend.forward(q, k, v, key_cache, value_cache, metas[i % sets])

    paged_s, mode = time_per_call(paged)
    row = {"shape": shape_name, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "batch": batch,
           "context": context, "partitions": metas[0].decode_partitions, "bytes": must_move, "timing": mode,
           "time_us": paged_s * 1e6, "GBps": must_move / paged_s / 1e9}
    del key_cache, value_cache, views, metas

    q = torch.randn(sets, batch, heads, 1, head_dim, dtype=DTYPE, device=DEVICE)
    k = torch.randn(sets, batch, kv_heads, context, head_dim, dtype=DTYPE, device=DEVICE)
    v = torch.randn_like(k)
    sdpa_s, _ = time_per_call(lambda i: F.scaled_dot_product_attention(q[i % sets], k[i % sets], v[i % sets],
                                                                        enable_gqa=True))
    row.update(sdpa_time_us=sdpa_s * 1e6, sdpa_GBps=must_move / sdpa_s / 1e9)
    del q, k, v
    torch.cuda.empty_cache()
    return row


def bench_prefill(shape_name, case) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape_name]
    query_lens, cached = PREFILL_CASES[case]
    backend = CupyPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    contexts = [c + n for c, n in zip(cached, query_lens)]
    blocks = [-(-ctx // BLOCK_SIZE) for ctx in contexts]
    num_blocks = sum(blocks)
    cache_shape = (num_blocks, kv_heads, BLOCK_SIZE, head_dim)
    key_cache = torch.empty(cache_shape, dtype=DTYPE, device=DEVICE).normal_()
    value_cache = torch.empty(cache_shape, dtype=DTYPE, device=DEVICE).normal_()
    perm = torch.randperm(num_blocks).tolist()
    tables, taken = [], 0
    for n_blocks in blocks:
        tables.append(perm[taken : taken + n_blocks])
        taken += n_blocks
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for n, ctx, t in zip(query_lens, contexts, tables) for p in range(ctx - n, ctx)]
    layout = BatchLayout(list(query_lens), contexts, tables, len(query_lens),
                         torch.tensor(slots, dtype=torch.int64, device=DEVICE), BLOCK_SIZE)
    meta = backend.build_metadata(layout, DEVICE)
    tokens = sum(query_lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=DTYPE, device=DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    # Multiply-adds of Q K^T and P V over the keys each query sees (its position + 1).
    flops = 4 * heads * head_dim * sum((ctx - n) * n + n * (n + 1) // 2 for n, ctx in zip(query_lens, contexts))
    seconds, mode = time_per_call(lambda i: backend.forward(q, k, v, key_cache, value_cache, meta), calls=5)
    row = {"shape": shape_name, "case": case, "tokens": tokens, "flops": flops, "timing": mode,
           "time_us": seconds * 1e6, "TFLOPs": flops / seconds / 1e12}
    del key_cache, value_cache, qkv
    if not any(cached) and len(set(query_lens)) == 1:
        n, seqs = query_lens[0], len(query_lens)
        sq = torch.randn(seqs, heads, n, head_dim, dtype=DTYPE, device=DEVICE)
        sk = torch.randn(seqs, kv_heads, n, head_dim, dtype=DTYPE, device=DEVICE)
        sv = torch.randn_like(sk)
        sdpa_s, _ = time_per_call(lambda i: F.scaled_dot_product_attention(sq, sk, sv, is_causal=True,
                                                                            enable_gqa=True), calls=5)
        row.update(sdpa_time_us=sdpa_s * 1e6, sdpa_TFLOPs=flops / sdpa_s / 1e12)
        del sq, sk, sv
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="headline decode point and one prefill case only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernel.py: no CUDA device; nothing measured")
        return 1
    torch.manual_seed(0)
    started = time.time()
    compile_s = time.time()
    registers = load_kernels(DEVICE)
    compile_s = time.time() - compile_s
    print(f"{torch.cuda.get_device_name()}: kernels loaded in {compile_s:.1f} s", flush=True)

    copy_bps = copy_bandwidth()
    print(f"device-to-device copy: {copy_bps / 1e9:.0f} GB/s (read + write)", flush=True)

    decode_points = [HEADLINE] if args.quick else [(s, b, c) for s in SHAPES for b in BATCHES for c in CONTEXTS]
    decode = []
    print(f"\n{'decode shape':20} {'batch':>5} {'ctx':>5} {'parts':>5} {'us':>9} {'GB/s':>7} {'of copy':>7} "
          f"{'sdpa us':>9} {'sdpa of copy':>12}")
    for shape_name, batch, context in decode_points:
        row = bench_decode(shape_name, batch, context)
        row["fraction_of_copy"] = row["GBps"] * 1e9 / copy_bps
        row["sdpa_fraction_of_copy"] = row["sdpa_GBps"] * 1e9 / copy_bps
        decode.append(row)
        print(f"{shape_name:20} {batch:>5} {context:>5} {row['partitions']:>5} {row['time_us']:>9.1f} "
              f"{row['GBps']:>7.0f} {row['fraction_of_copy']:>7.2f} {row['sdpa_time_us']:>9.1f} "
              f"{row['sdpa_fraction_of_copy']:>12.2f}", flush=True)

    prefill_points = [("qwen2.5-0.5b-like", "prompt 4096")] if args.quick else [
        (s, c) for s in SHAPES for c in PREFILL_CASES]
    prefill = []
    print(f"\n{'prefill shape':20} {'case':28} {'us':>9} {'TFLOP/s':>8} {'sdpa TFLOP/s':>12}")
    for shape_name, case in prefill_points:
        row = bench_prefill(shape_name, case)
        prefill.append(row)
        sdpa = f"{row['sdpa_TFLOPs']:>12.1f}" if "sdpa_TFLOPs" in row else f"{'-':>12}"
        print(f"{shape_name:20} {case:28} {row['time_us']:>9.1f} {row['TFLOPs']:>8.1f} {sdpa}", flush=True)

    headline = next(r for r in decode if (r["shape"], r["batch"], r["context"]) == HEADLINE)
    ratios = {"decode_vs_copy_bw": round(headline["fraction_of_copy"], 4),
              "decode_vs_sdpa_time": round(headline["sdpa_time_us"] / headline["time_us"], 4)}
    metrics = {
        "device": torch.cuda.get_device_name(),
        "dtype": "bfloat16",
        "block_size": BLOCK_SIZE,
        "copy_GBps": copy_bps / 1e9,
        "kernel_load_s": compile_s,
        "registers": registers,
        "timing": "CUDA graph of 10 calls (5 for prefill), median of 7 replays after 3 warm-up calls",
        "decode": decode,
        "prefill": prefill,
        "elapsed_s": time.time() - started,
    }
    path = write_result("kernel", ratios, metrics)
    print(f"\ndecode_vs_copy_bw at batch 64, context 2048, qwen-like: {ratios['decode_vs_copy_bw']:.3f}; "
          f"wrote {path} in {metrics['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
