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

Part 2, end to end: decode steps of the executor (ModelRunner.execute: metadata, the model, logits and
greedy sampling, tokens back on the host) for a random-weight Qwen2.5-0.5B-shaped checkpoint written here,
bf16, 64 sequences at contexts 1,985 to 2,024, with CUDA graphs and without (enforce_eager). The floor is
the bytes a step must read (every weight once, the LM head included, and every sequence's K/V of every
layer) over the copy bandwidth of the same run; decode_e2e_vs_floor_{graphs,eager} = floor time / step
time (1.0 would be a step at the copy bandwidth).

Shapes: Qwen2.5-0.5B-like (14 / 2 heads x 64), Llama-3.2-1B-like (32 / 8 x 64), Llama-3.1-8B-like
(32 / 8 x 128); decode at batch 1, 8, 64, 256 and contexts 512, 2048, 8192; three prefill cases each.

Nothing measured is lost: kernel.json is rewritten after every point (metrics.status says "running" until
the end), a point that raises is recorded under metrics.errors and the next one still runs, and the time
budget (TIME_BUDGET_S) counts from process start: the headline decode point and part 2 run first whatever
the budget, then batch 64 x 2048 of the other shapes, then the rest while time remains (points left out
are listed under "skipped"). --dry-run measures nothing and writes the plan (no CUDA needed).
"""
from __future__ import annotations

import time

PROCESS_START = time.monotonic()  # the time budget counts from here, before the imports (torch takes seconds)

import argparse
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import write_result  # noqa: E402
from executor_svc.attention.cupy_backend import CupyPagedAttention, decode_slots, load_kernels  # noqa: E402
from executor_svc.attention.layout import BatchLayout  # noqa: E402

SHAPES = {  # (heads, KV heads, head_dim)
    "qwen2.5-0.5b-like": (14, 2, 64), "llama-3.2-1b-like": (32, 8, 64), "llama-3.1-8b-like": (32, 8, 128),
}
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192)
HEADLINE = ("qwen2.5-0.5b-like", 64, 2048)
PREFILL_CASES = {  # name: (query lengths, cached lengths)
    "prompt 4096": ([4096], [0]),
    "8 prompts x 512": ([512] * 8, [0] * 8),
    "chunk 2048 over 6144 cached": ([2048], [6144]),
}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
TIME_BUDGET_S = 80  # from process start; tools/gpu_check.sh kills the benchmark at 100 s
# Part 2: Qwen2.5-0.5B's shape (494M parameters, 136M of them the tied embedding / LM head).
E2E_CONFIG = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)
E2E_BATCH, E2E_CONTEXT, E2E_WARMUP, E2E_STEPS = 64, 1984, 8, 32  # contexts 1985 .. 2024: the 2,048-key graphs
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


# ---- part 2: the executor end to end ------------------------------------------------------------------


def write_random_qwen2(path, config: dict, dtype: torch.dtype = DTYPE, device="cuda", seed: int = 0) -> int:
    """Writes a Qwen2-architecture checkpoint with random weights (std 0.02, norms 1) to `path`; returns its
    parameter count. Tensors are drawn on `device` (fast on a GPU) and saved as one safetensors file."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    Qwen2Config(**config, bos_token_id=0, eos_token_id=config["vocab_size"] - 1,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}).save_pretrained(path)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads
    gen = torch.Generator(device).manual_seed(seed)

    def rand(*shape):
        return (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype).cpu()

    def ones(n):
        return torch.ones(n, dtype=dtype)

    weights = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": ones(h)}
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = rand(vocab, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
            weights[f"{p}self_attn.{name}_proj.weight"] = rand(rows, h)
            weights[f"{p}self_attn.{name}_proj.bias"] = rand(rows)
        weights[f"{p}self_attn.o_proj.weight"] = rand(h, heads * d)
        weights[f"{p}mlp.gate_proj.weight"] = rand(inter, h)
        weights[f"{p}mlp.up_proj.weight"] = rand(inter, h)
        weights[f"{p}mlp.down_proj.weight"] = rand(h, inter)
        weights[f"{p}input_layernorm.weight"] = ones(h)
        weights[f"{p}post_attention_layernorm.weight"] = ones(h)
    save_file(weights, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in weights.values())


def decode_floor_bytes(runner, context_lens) -> tuple[int, int]:
    """(weight bytes, K/V bytes) one decode step over sequences at these context lengths must read: every
    parameter once (a tied embedding counts once, as the LM head; an untied one is only gathered from, a
    row per token, so it is left out) and the K and V of every context position of every layer."""
    model, config = runner.model, runner.config
    weight_element = model.embed_tokens.weight.element_size()
    weight = model.weight_numel() * weight_element
    if model.lm_head is not None:
        weight -= model.embed_tokens.weight.numel() * weight_element
    kv_element = runner.kv_caches[0][0].element_size()
    kv = int(sum(context_lens)) * config.num_layers * 2 * config.num_kv_heads * config.head_dim * kv_element
    return weight, kv


class DecodeLoop:
    """`batch` sequences decoding from position `context` on, one ModelRunner.execute per step, each fed the
    token it sampled. Their earlier K/V are whatever the cache holds (the caller fills it): a decode step
    reads the same bytes whatever they are."""

    def __init__(self, runner, batch: int, context: int, seed: int = 0) -> None:
        from pagedserve.sampling_params import SamplingParams

        self.runner = runner
        rng = random.Random(seed)
        self.tokens = {f"seq{i}": rng.randrange(runner.config.vocab_size) for i in range(batch)}
        self.position = context  # of each sequence's next token
        self.tables: dict[str, list[int]] = {rid: [] for rid in self.tokens}
        self.free = iter(range(runner.num_blocks))
        self.params = SamplingParams(temperature=0, ignore_eos=True)
        self.started = False

    def step(self) -> None:
        from pagedserve.step import ExecuteRequest, ExecuteStep

        block_size = self.runner.block_size
        requests = []
        for rid, token in self.tokens.items():
            table = self.tables[rid]
            new_blocks = [next(self.free) for _ in range(self.position // block_size + 1 - len(table))]
            table.extend(new_blocks)
            requests.append(ExecuteRequest(
                request_id=rid, token_ids=[token], start_position=self.position, new_block_ids=new_blocks,
                sample=True, sampling_params=None if self.started else self.params, prompt_len=self.position,
            ))
        result = self.runner.execute(ExecuteStep(requests))
        self.tokens = {rid: result.sampled[rid].token_id for rid in self.tokens}
        self.started = True
        self.position += 1


def bench_e2e(model_dir, copy_bps: float, enforce_eager: bool, *, batch=E2E_BATCH, context=E2E_CONTEXT,
              warmup=E2E_WARMUP, steps=E2E_STEPS, device="cuda", dtype="bfloat16") -> dict:
    """Decode steps per second of a ModelRunner, with CUDA graphs (batch size `batch` captured) or eagerly."""
    from transformers import AutoConfig

    from executor_svc.model_config import ModelArchitecture, parse_dtype
    from executor_svc.model_runner import ModelRunner
    from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig

    config = ModelArchitecture.from_hf_config(AutoConfig.from_pretrained(model_dir), None)
    blocks = batch * -(-(context + warmup + steps + 1) // BLOCK_SIZE) + 8
    block_bytes = config.kv_bytes_per_token(parse_dtype(dtype)) * BLOCK_SIZE
    runner = ModelRunner(ModelConfig(str(model_dir), dtype=dtype, device=device, cuda_graph_batch_sizes=[batch],
                                     enforce_eager=enforce_eager),
                         CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=blocks * block_bytes),
                         SchedulerConfig(max_num_seqs=batch))
    for key_cache, value_cache in runner.kv_caches:  # stands in for the prompts' K/V
        key_cache.normal_()
        value_cache.normal_()
    loop = DecodeLoop(runner, batch, context)
    for _ in range(warmup):
        loop.step()
    contexts = []
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        contexts.append(loop.position + 1)
        loop.step()
    if device != "cpu":
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    weight_bytes, kv_bytes = decode_floor_bytes(runner, [statistics.mean(contexts)] * batch)
    floor_s = (weight_bytes + kv_bytes) / copy_bps
    graphs = runner.decode_graphs
    row = {"mode": "eager" if enforce_eager else "cuda-graphs", "batch": batch,
           "contexts": [contexts[0], contexts[-1]], "steps": steps, "attention_backend": runner.attention_backend_name,
           "graph_replays": graphs.num_replays if graphs is not None else 0, "step_ms": step_s * 1e3,
           "tokens_per_s": batch / step_s, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
           "floor_ms": floor_s * 1e3, "vs_floor": floor_s / step_s}
    del loop, runner, graphs
    if device != "cpu":
        torch.cuda.empty_cache()
    return row


def run_e2e(results: "Results") -> list[dict]:
    """Part 2, each mode a point of its own (a failure in one is recorded and the other still runs)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="qwen-like-") as model_dir:
        written = time.time()
        params = results.attempt("e2e", ["write checkpoint"], lambda: write_random_qwen2(model_dir, E2E_CONFIG))
        if params is None:
            return rows
        print(f"\nexecutor decode, Qwen2.5-0.5B-like random weights ({params / 1e6:.0f}M parameters, written in "
              f"{time.time() - written:.1f} s), bf16, batch {E2E_BATCH}, contexts from {E2E_CONTEXT + 1}", flush=True)
        print(f"{'mode':12} {'replays':>7} {'step ms':>8} {'tokens/s':>9} {'floor ms':>8} {'of floor':>8}")
        for enforce_eager in (False, True):
            row = results.attempt("e2e", ["eager" if enforce_eager else "cuda-graphs"],
                                  lambda: bench_e2e(model_dir, results.copy_bps, enforce_eager))
            if row is None:
                continue
            rows.append(row)
            print(f"{row['mode']:12} {row['graph_replays']:>7} {row['step_ms']:>8.2f} {row['tokens_per_s']:>9.0f} "
                  f"{row['floor_ms']:>8.2f} {row['vs_floor']:>8.3f}", flush=True)
    if rows and rows[0]["mode"] == "cuda-graphs" and rows[0]["graph_replays"] != E2E_WARMUP + E2E_STEPS:
        print(f"  warning: {rows[0]['graph_replays']} graph replays in {E2E_WARMUP + E2E_STEPS} steps: the "
              "graph figures are (partly) eager", flush=True)
    return rows


class Results:
    """kernel.json, rewritten after every measured point so that a killed run keeps what it measured."""

    def __init__(self, copy_bps: float | None = None) -> None:
        self.copy_bps = copy_bps
        self.decode: list[dict] = []
        self.prefill: list[dict] = []
        self.e2e: list[dict] = []
        self.errors: list[dict] = []
        self.skipped: list[dict] = []
        self.metrics: dict = {}

    def ratios(self) -> dict:
        ratios = {}
        headline = next((r for r in self.decode if (r["shape"], r["batch"], r["context"]) == HEADLINE), None)
        if headline is not None:
            ratios["decode_vs_copy_bw"] = round(headline["fraction_of_copy"], 4)
            ratios["decode_vs_sdpa_time"] = round(headline["sdpa_time_us"] / headline["time_us"], 4)
        modes = {row["mode"]: row for row in self.e2e}
        if "cuda-graphs" in modes:
            ratios["decode_e2e_vs_floor_graphs"] = round(modes["cuda-graphs"]["vs_floor"], 4)
        if "eager" in modes:
            ratios["decode_e2e_vs_floor_eager"] = round(modes["eager"]["vs_floor"], 4)
        if len(modes) == 2:
            ratios["decode_e2e_graphs_speedup"] = round(modes["eager"]["step_ms"] / modes["cuda-graphs"]["step_ms"], 4)
        return ratios

    def write(self, status: str) -> Path:
        metrics = {"status": status, **self.metrics, "decode": self.decode, "prefill": self.prefill,
                   "decode_e2e": self.e2e, "errors": self.errors, "skipped": self.skipped,
                   "elapsed_s": round(elapsed(), 1)}
        if self.copy_bps is not None:
            metrics["copy_GBps"] = self.copy_bps / 1e9
        return write_result("kernel", self.ratios(), metrics)

    def attempt(self, kind: str, point, measure) -> dict | None:
        """Runs one point; a failure is recorded with the point (and printed), never raised."""
        try:
            return measure()
        except Exception as exc:  # a kernel fault or an out-of-memory error: the next point may still run
            message = f"{type(exc).__name__}: {exc}"
            self.errors.append({kind: list(point), "error": message})
            print(f"  {kind} {point}: FAILED, {message}", flush=True)
            torch.cuda.empty_cache()
            return None


def elapsed() -> float:
    return time.monotonic() - PROCESS_START


def planned_points(quick: bool) -> tuple[list[tuple], list[tuple]]:
    """(decode points, prefill points), the headline first, then batch 64 x 2048 of every shape, then the rest."""
    if quick:
        return [HEADLINE], [("qwen2.5-0.5b-like", "prompt 4096")]
    first = [HEADLINE] + [(s, 64, 2048) for s in SHAPES if (s, 64, 2048) != HEADLINE]
    decode = first + [(s, b, c) for s in SHAPES for b in BATCHES for c in CONTEXTS if (s, b, c) not in first]
    return decode, [(s, c) for s in SHAPES for c in PREFILL_CASES]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="headline decode point and one prefill case only")
    parser.add_argument("--budget", type=float, default=TIME_BUDGET_S,
                        help="seconds from process start after which the remaining points are skipped")
    parser.add_argument("--dry-run", action="store_true",
                        help="measure nothing: write kernel.json with the planned points (no CUDA needed)")
    args = parser.parse_args(argv)
    decode_points, prefill_points = planned_points(args.quick)
    results = Results()
    if args.dry_run:
        results.skipped = [{"decode": list(p)} for p in decode_points] + [{"prefill": list(p)} for p in prefill_points]
        path = results.write("dry-run")
        print(f"bench/kernel.py dry run: {len(decode_points)} decode and {len(prefill_points)} prefill points "
              f"planned, budget {args.budget:.0f} s; wrote {path}")
        return 0
    if not torch.cuda.is_available():
        path = results.write("no CUDA device")
        print(f"bench/kernel.py: no CUDA device; nothing measured; wrote {path}")
        return 1
    torch.manual_seed(0)
    load_started = time.monotonic()
    registers = load_kernels(DEVICE)
    results.metrics = {
        "device": torch.cuda.get_device_name(), "dtype": "bfloat16", "block_size": BLOCK_SIZE,
        "kernel_load_s": time.monotonic() - load_started, "registers": registers,
        "decode_slots": {d: decode_slots(DEVICE, d) for d in (64, 128)},
        "timing": "CUDA graph of 10 calls (5 for prefill), median of 7 replays after 3 warm-up calls",
        "e2e_timing": f"ModelRunner.execute, {E2E_WARMUP} warm-up steps then {E2E_STEPS} timed, wall clock",
        "e2e_config": E2E_CONFIG, "budget_s": args.budget,
    }
    print(f"{torch.cuda.get_device_name()}: kernels loaded in {results.metrics['kernel_load_s']:.1f} s", flush=True)
    results.copy_bps = copy_bandwidth()
    print(f"device-to-device copy: {results.copy_bps / 1e9:.0f} GB/s (read + write)", flush=True)
    results.write("running")

    decode_header = (f"\n{'decode shape':20} {'batch':>5} {'ctx':>5} {'parts':>5} {'us':>9} {'GB/s':>7} "
                     f"{'of copy':>7} {'sdpa us':>9} {'sdpa of copy':>12}")

    def decode_row(point):
        row = bench_decode(*point)
        row["fraction_of_copy"] = row["GBps"] * 1e9 / results.copy_bps
        row["sdpa_fraction_of_copy"] = row["sdpa_GBps"] * 1e9 / results.copy_bps
        results.decode.append(row)
        print(f"{point[0]:20} {point[1]:>5} {point[2]:>5} {row['partitions']:>5} {row['time_us']:>9.1f} "
              f"{row['GBps']:>7.0f} {row['fraction_of_copy']:>7.2f} {row['sdpa_time_us']:>9.1f} "
              f"{row['sdpa_fraction_of_copy']:>12.2f}", flush=True)
        return row

    print(decode_header)
    # The headline first, then part 2: both run whatever the budget says, the sweep fills what is left.
    results.attempt("decode", decode_points[0], lambda: decode_row(decode_points[0]))
    results.write("running")
    results.e2e = run_e2e(results)
    results.write("running")

    print(decode_header)
    for point in decode_points[1:]:
        if elapsed() > args.budget:
            results.skipped.append({"decode": list(point)})
            continue
        results.attempt("decode", point, lambda: decode_row(point))
        results.write("running")

    print(f"\n{'prefill shape':20} {'case':28} {'us':>9} {'TFLOP/s':>8} {'sdpa TFLOP/s':>12}")
    for point in prefill_points:
        if elapsed() > args.budget:
            results.skipped.append({"prefill": list(point)})
            continue
        row = results.attempt("prefill", point, lambda: bench_prefill(*point))
        if row is not None:
            results.prefill.append(row)
            sdpa = f"{row['sdpa_TFLOPs']:>12.1f}" if "sdpa_TFLOPs" in row else f"{'-':>12}"
            print(f"{point[0]:20} {point[1]:28} {row['time_us']:>9.1f} {row['TFLOPs']:>8.1f} {sdpa}", flush=True)
        results.write("running")
    if results.skipped:
        print(f"\nskipped for time (budget {args.budget:.0f} s from process start): {len(results.skipped)} points",
              flush=True)

    status = "complete" if not results.errors else f"complete, {len(results.errors)} points failed"
    path = results.write(status)
    ratios = results.ratios()
    print(f"\n{status}; ratios {ratios}; wrote {path} at {elapsed():.0f} s from process start")
    return 0 if "decode_vs_copy_bw" in ratios and not results.errors else 1


if __name__ == "__main__":
    sys.exit(main())
