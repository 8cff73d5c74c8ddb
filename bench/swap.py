"""Preemption by swap against recompute and the automatic choice, with a KV pool a quarter of what the load
needs: a W-like load scaled down for two cores (default 32 requests, prompts of 64-256 random token ids, 64
greedy output tokens each, all at once, the default model in float32) through the in-process engine, once per
preemption mode, the modes interleaved over the rounds of one run. Recompute runs twice: as configured by
default (the prefix cache and its host offload tier keep a preempted request's full blocks, which come back
from there), and without the offload tier (only what stays in the pool comes back). Every mode must give the
same tokens. Writes bench/results/swap.json: `swap_vs_recompute`, `swap_vs_recompute_no_tier` and
`auto_vs_best` (output tokens per wall second, each mode's best round; the same per CPU second of the process,
which other load on a shared machine disturbs less, as `*_cpu`), with each mode's preemptions, swaps, blocks
copied and tokens computed.

    python bench/swap.py [--num-requests 32] [--max-prompt 256] [--output-len 64] [--rounds 2] [--threads 1]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import workload_w, write_result  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402

# name: the options that make the mode
MODES = {"swap": {"preemption_mode": "swap"}, "recompute": {"preemption_mode": "recompute"},
         "recompute_no_tier": {"preemption_mode": "recompute", "offload": "none"},
         "auto": {"preemption_mode": "auto"}}


def run_mode(args, prompts, mode: str, num_blocks: int, block_bytes: int) -> tuple[dict, list[list[int]]]:
    llm = LLM(args.model, device="cpu", dtype=args.dtype, block_size=args.block_size, cpu_threads=args.threads,
              kv_cache_memory=num_blocks * block_bytes, **MODES[mode])
    assert llm.runner.num_blocks == num_blocks
    llm.generate([p[:8] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    manager, runner = llm.block_manager, llm.runner
    before = manager.stats() | {"computed": runner.num_prefill_tokens + runner.num_decode_tokens}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    results = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = manager.stats() | {"computed": runner.num_prefill_tokens + runner.num_decode_tokens}
    delta = {key: after[key] - before[key] for key in ("num_preemptions", "num_swaps", "blocks_swapped_out",
                                                       "blocks_swapped_in", "tier_hits", "computed")}
    output_tokens = sum(len(r.token_ids) for r in results)
    assert output_tokens == len(prompts) * args.output_len
    assert runner.swap_space.num_bytes == 0, "swapped copies left behind"
    metrics = {
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "output_tok_per_s": output_tokens / elapsed,
        "output_tok_per_cpu_s": output_tokens / cpu,
        "preemptions": delta["num_preemptions"],
        "swaps": delta["num_swaps"],
        "blocks_swapped_out": delta["blocks_swapped_out"],
        "blocks_swapped_in": delta["blocks_swapped_in"],
        "tokens_loaded_from_tier": delta["tier_hits"],
        # Tokens whose K/V the executor computed: prompt and output tokens, plus whatever was recomputed.
        "tokens_computed": delta["computed"],
    }
    estimate = {"prefill_tokens_per_s": runner.prefill_tokens_per_s, "copy_bytes_per_s": runner.copy_bytes_per_s}
    del llm
    gc.collect()
    return metrics | {"estimate": estimate}, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="of the blocks the load needs")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: every core); with 1, CPU seconds are the work itself, "
                             "whatever else the machine runs")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every mode, interleaved; the best counts")
    parser.add_argument("--name", default="swap", help="result file name under bench/results/")
    args = parser.parse_args()

    from transformers import AutoConfig

    from executor_svc.model_config import ModelArchitecture, parse_dtype
    from executor_svc.model_loader import resolve_model_dir

    architecture = ModelArchitecture.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(args.model)))
    block_bytes = architecture.kv_bytes_per_token(parse_dtype(args.dtype)) * args.block_size
    prompts = workload_w(args.num_requests, args.min_prompt, args.max_prompt, architecture.vocab_size)
    needed = sum(-(-(len(p) + args.output_len) // args.block_size) for p in prompts)
    num_blocks = int(needed * args.pool_fraction)

    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    outputs = {}
    for round_ in range(args.rounds):
        for mode in MODES:
            metrics, outputs[mode] = run_mode(args, prompts, mode, num_blocks, block_bytes)
            runs[mode].append(metrics)
            print(f"round {round_ + 1} {mode}: {metrics['output_tok_per_s']:.1f} output tok/s "
                  f"({metrics['output_tok_per_cpu_s']:.1f} per CPU s) "
                  f"({metrics['seconds']:.1f} s), {metrics['preemptions']} preemptions, {metrics['swaps']} swaps, "
                  f"{metrics['blocks_swapped_out']} blocks out, {metrics['blocks_swapped_in']} in, "
                  f"{metrics['tokens_computed']} tokens computed", flush=True)
        assert all(tokens == outputs["swap"] for tokens in outputs.values()), "the modes' outputs differ"
    ratios = {}
    for suffix, key in (("", "output_tok_per_s"), ("_cpu", "output_tok_per_cpu_s")):
        best = {mode: max(r[key] for r in runs[mode]) for mode in MODES}
        ratios |= {f"swap_vs_recompute{suffix}": best["swap"] / best["recompute"],
                   f"swap_vs_recompute_no_tier{suffix}": best["swap"] / best["recompute_no_tier"],
                   f"auto_vs_best{suffix}": best["auto"] / max(best["swap"], best["recompute"])}
    print(", ".join(f"{key} {value:.3f}" for key, value in ratios.items()))
    metrics = {"workload": {"num_requests": args.num_requests, "prompt_len": [args.min_prompt, args.max_prompt],
                            "output_len": args.output_len, "dtype": args.dtype, "block_size": args.block_size,
                            "blocks_needed": needed, "kv_blocks": num_blocks, "rounds": args.rounds,
                            "torch_threads": args.threads},
               **runs}
    print(f"wrote {write_result(args.name, ratios, metrics)}")


if __name__ == "__main__":
    main()
