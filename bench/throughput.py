"""Output-token throughput on workload W: the in-process engine, the full stack of four services, and
transformers' generate_batch, against the bound the model's linear layers alone set.

All run the same model, dtype and prompts, side by side in one run; the ratios are what count (absolute
times on shared machines drift). The bound (`stack_vs_gemm_bound`, the headline) times the linear layers
alone (bench/roofline.py's measure) over W's tokens: the prompt tokens in chunks of the token budget with
the LM head on one row per request, then W's decode steps at the largest batch the engine reached; it is
timed after each run, and each part's fastest counts. With --rounds N every system runs N times, the rounds
interleaved, and each system's fastest run counts, as the bound's fastest timing does. The engine's run
also clocks its own linear layers and attention as they run: where its time went beside the bound, and the
most of the bound it could reach with attention as fast as it ran (`ceiling_vs_gemm_bound`). Writes
bench/results/throughput.json.

    python bench/throughput.py [--dtype float32|bfloat16|auto] [--kv-cache-dtype auto|bfloat16]
                               [--num-requests 64] [--rounds 1] [--skip-hf] [--skip-stack]
                               [--temperature 0.7 --top-p 0.9]  (W sampled rather than greedy)
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import workload_w, write_result  # noqa: E402
from executor_svc.costs import linear_layers_seconds  # noqa: E402
from executor_svc.models.llama import Attention  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.config import ModelConfig  # noqa: E402


def clock_model_parts(model) -> dict[str, float]:
    """Wall seconds the model then spends in its parts, summed over their calls: `linear`, what the bound times
    (every nn.Linear of the decoder layers, and the LM head; a mixture of experts' routed experts are left to the
    rest), and `attention` (the attention backends' forward: the cache write and the attention itself). The
    clocks wrap those calls (a microsecond each; the model runs on one thread)."""
    seconds = {"linear": 0.0, "attention": 0.0}

    def clock(owner, attribute: str, part: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
        setattr(owner, attribute, timed)

    backends = {}
    for module in model.layers.modules():
        if isinstance(module, nn.Linear):
            clock(module, "forward", "linear")
        elif isinstance(module, Attention):
            backends[id(module.backend)] = module.backend  # one backend may serve every layer
    for backend in backends.values():
        clock(backend, "forward", "attention")
    clock(model, "compute_logits", "linear")
    return seconds


def run_engine(args, prompts) -> tuple[dict, LLM]:
    """The engine's run, and the engine (its model times the bound); the run's seconds in the linear layers and
    in attention (clock_model_parts)."""
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
              kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.output_len,
                            ignore_eos=True)
    llm.generate([p[:8] for p in prompts[:4]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    parts = clock_model_parts(llm.runner.model)

    # Sample KV waste (allocated but unused slots) after every step, and the largest batch of running requests.
    used_total = allocated_total = 0
    steps = peak_batch = 0
    schedule = llm.scheduler.schedule

    def schedule_and_count():
        nonlocal used_total, allocated_total, steps, peak_batch
        step = schedule()
        used, allocated = llm.block_manager.slot_usage()
        used_total += used
        allocated_total += allocated
        steps += 1
        peak_batch = max(peak_batch, len(llm.scheduler.running))
        return step

    llm.scheduler.schedule = schedule_and_count
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(r.token_ids) for r in results)
    assert output_tokens == len(prompts) * args.output_len
    return {
        "seconds": elapsed,
        "linear_seconds": parts["linear"],
        "attention_seconds": parts["attention"],
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (output_tokens + sum(map(len, prompts))) / elapsed,
        "steps": steps,
        "kv_waste": 1 - used_total / allocated_total,
        "preemptions": llm.scheduler.num_preemptions,
        "kv_blocks": llm.runner.num_blocks,
        "peak_batch": peak_batch,
    }, llm


def time_gemm_bound(model, args, prompts, decode_batch: int, repeats: int = 3) -> tuple[float, float]:
    """Seconds of W's linear layers alone, (prefill, decode): the prompt tokens in chunks of the token budget
    (then the LM head on each request's last prompt token), and output_len - 1 decode steps at decode_batch
    (the first output token comes from the prefill), every projection and the LM head on every row."""
    budget = args.max_num_batched_tokens
    num_chunks, rest = divmod(sum(map(len, prompts)), budget)
    prefill_s = num_chunks * linear_layers_seconds(model, budget, 0, repeats=repeats)
    if rest:
        prefill_s += linear_layers_seconds(model, rest, 0, repeats=repeats)
    prefill_s += linear_layers_seconds(model, 0, len(prompts), num_layers=0, repeats=repeats)
    decode_s = (args.output_len - 1) * linear_layers_seconds(model, decode_batch, decode_batch, repeats=repeats)
    return prefill_s, decode_s


def gemm_bound(timings: list[tuple[float, float]], prompts, args, decode_batch: int) -> dict:
    """The bound from its timings taken between the runs: each part's fastest, so that a spell in which the
    shared host lent less of its cores does not make the bound look slower than the linear layers are."""
    prefill_s, decode_s = min(t[0] for t in timings), min(t[1] for t in timings)
    output_tokens = len(prompts) * args.output_len
    return {"seconds": prefill_s + decode_s, "prefill_seconds": prefill_s, "decode_seconds": decode_s,
            "timings": [list(t) for t in timings], "decode_batch": decode_batch, "output_tokens": output_tokens,
            "output_tok_per_s": output_tokens / (prefill_s + decode_s)}


def run_stack(args, prompts) -> dict:
    """W through the public gRPC API: every request a stream, all from one asyncio loop, as remote clients
    would be (a thread per stream would wake 64 threads a step on the cores the executor computes on)."""
    import grpc

    from pagedserve.client import build_request
    from pagedserve.config import PagedServeConfig
    from pagedserve.entrypoints.launcher import Stack
    from pagedserve.v1 import generate_pb2_grpc

    config = PagedServeConfig.from_kwargs(model=args.model, device=args.device, dtype=args.dtype, port=0,
                                          kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                                          max_num_batched_tokens=args.max_num_batched_tokens)

    async def generate(stub, prompt: list[int], max_tokens: int) -> int:
        request = build_request(prompt_token_ids=prompt, temperature=args.temperature, top_p=args.top_p,
                                max_tokens=max_tokens, ignore_eos=True)
        return sum([len(response.token_ids) async for response in stub.Generate(request)])

    async def load(address: str) -> tuple[list[int], float]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            await generate(stub, prompts[0][:8], 2)  # warm-up
            start = time.perf_counter()
            counts = await asyncio.gather(*(generate(stub, prompt, args.output_len) for prompt in prompts))
            return counts, time.perf_counter() - start

    with Stack(config) as stack:
        counts, elapsed = asyncio.run(load(stack.address))
    output_tokens = sum(counts)
    assert output_tokens == len(prompts) * args.output_len
    return {"seconds": elapsed, "output_tokens": output_tokens, "output_tok_per_s": output_tokens / elapsed}


def run_hf(args, prompts, model_dir) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    config = GenerationConfig(
        max_new_tokens=args.output_len, min_new_tokens=args.output_len, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.eos_token_id,
        **({"do_sample": True, "temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0
           else {"do_sample": False}),
    )
    model.generate_batch([p[:8] for p in prompts[:4]], generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.eos_token_id))  # warm-up
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return {
        "seconds": elapsed,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / elapsed,
    }


def fastest(runs: list[dict]) -> dict:
    """A system's fastest run, with every round's seconds beside it."""
    return {**min(runs, key=lambda run: run["seconds"]), "seconds_each_round": [run["seconds"] for run in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="auto: as the executor picks it for this CPU (bfloat16 with native bfloat16 matrix "
                             "instructions), for every system of the run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="the K/V's dtype in the engine and the stack (transformers keeps the model's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as W is; above, sampled")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every system, interleaved; each system's fastest counts")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers baseline (no *_vs_hf ratio)")
    parser.add_argument("--skip-stack", action="store_true", help="no run through the four services")
    parser.add_argument("--name", default="throughput", help="result file name under bench/results/")
    args = parser.parse_args()
    requested_dtype = args.dtype
    # The same dtype for every system. `auto` times the CPU's products, on a thread of its own: torch's OpenMP
    # pool goes with that thread, and the engine's (on the thread that loads its model) is then the process's
    # only one, as in the executor service.
    with ThreadPoolExecutor(max_workers=1) as resolver:
        resolved = resolver.submit(ModelConfig(dtype=args.dtype, device=args.device).resolved).result()
    args.dtype = resolved.dtype

    prompts = workload_w(args.num_requests)
    runs: dict[str, list[dict]] = {"engine": [], "stack": [], "transformers_generate_batch": []}
    timings = []
    for round_index in range(args.rounds):
        engine, llm = run_engine(args, prompts)
        runs["engine"].append(engine)
        print(f"round {round_index + 1}: engine {engine['output_tok_per_s']:.1f} output tok/s "
              f"({engine['seconds']:.1f} s), kv_waste {engine['kv_waste']:.4f}", flush=True)
        # The bound is timed after each run (the model kept, the engine's KV pool let go: the stack allocates its
        # own; the engine's step counter holds the engine in a cycle).
        model, decode_batch = llm.runner.model, engine["peak_batch"]
        del llm
        gc.collect()
        timings.append(time_gemm_bound(model, args, prompts, decode_batch))
        if not args.skip_stack:
            runs["stack"].append(run_stack(args, prompts))
            print(f"round {round_index + 1}: stack {runs['stack'][-1]['seconds']:.1f} s", flush=True)
            timings.append(time_gemm_bound(model, args, prompts, decode_batch))
        if not args.skip_hf:
            from executor_svc.model_loader import resolve_model_dir

            hf = run_hf(args, prompts, resolve_model_dir(args.model))
            runs["transformers_generate_batch"].append(hf)
            print(f"round {round_index + 1}: transformers {hf['seconds']:.1f} s", flush=True)
            timings.append(time_gemm_bound(model, args, prompts, decode_batch))
    engine = fastest(runs["engine"])
    metrics = {"workload": {"num_requests": args.num_requests, "prompt_len": [64, 512],
                            "output_len": args.output_len, "temperature": args.temperature, "top_p": args.top_p,
                            "dtype": args.dtype, "dtype_requested": requested_dtype,
                            "kv_cache_dtype": args.kv_cache_dtype,
                            "device": args.device, "max_num_batched_tokens": args.max_num_batched_tokens},
               "rounds": args.rounds, "engine": engine}
    metrics.update({name: fastest(runs[name]) for name in ("stack", "transformers_generate_batch") if runs[name]})
    bound = metrics["gemm_bound"] = gemm_bound(timings, prompts, args, decode_batch)
    # Where the engine's run went: its linear layers (against the bound's time for them), attention, and the rest
    # (norms, activations, the rotary embedding, sampling, scheduling). With attention as fast as it ran, the
    # engine could reach at most `ceiling_vs_gemm_bound` of the bound.
    engine["other_seconds"] = engine["seconds"] - engine["linear_seconds"] - engine["attention_seconds"]
    engine["ceiling_vs_gemm_bound"] = bound["seconds"] / (bound["seconds"] + engine["attention_seconds"])
    print(f"engine: {engine['output_tok_per_s']:.1f} output tok/s ({engine['seconds']:.1f} s: linear layers "
          f"{engine['linear_seconds']:.1f}, attention {engine['attention_seconds']:.1f}, the rest "
          f"{engine['other_seconds']:.1f}; at most {engine['ceiling_vs_gemm_bound']:.3f} of the bound with this "
          "attention)", flush=True)
    print(f"linear layers alone: {bound['output_tok_per_s']:.1f} output tok/s ({bound['seconds']:.1f} s; timed "
          + ", ".join(f"{p + d:.1f}" for p, d in timings) + " s after each run)", flush=True)
    ratios = {"kv_waste": engine["kv_waste"],
              "engine_vs_gemm_bound": engine["output_tok_per_s"] / bound["output_tok_per_s"]}
    if "stack" in metrics:
        stack = metrics["stack"]
        ratios["stack_vs_engine"] = stack["output_tok_per_s"] / engine["output_tok_per_s"]
        ratios["stack_vs_gemm_bound"] = stack["output_tok_per_s"] / bound["output_tok_per_s"]
        print(f"stack: {stack['output_tok_per_s']:.1f} output tok/s ({stack['seconds']:.1f} s), "
              f"stack_vs_engine {ratios['stack_vs_engine']:.3f}, "
              f"stack_vs_gemm_bound {ratios['stack_vs_gemm_bound']:.3f}", flush=True)
    if "transformers_generate_batch" in metrics:
        hf = metrics["transformers_generate_batch"]
        print(f"transformers generate_batch: {hf['output_tok_per_s']:.1f} output tok/s ({hf['seconds']:.1f} s)")
        ratios["engine_vs_hf"] = engine["output_tok_per_s"] / hf["output_tok_per_s"]
        print(f"engine_vs_hf: {ratios['engine_vs_hf']:.2f}")
        if "stack" in metrics:
            ratios["stack_vs_hf"] = metrics["stack"]["output_tok_per_s"] / hf["output_tok_per_s"]
            print(f"stack_vs_hf: {ratios['stack_vs_hf']:.2f}")
    path = write_result(args.name, ratios, metrics)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
