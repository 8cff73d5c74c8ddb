"""Decode against its roofline on the CPU: decode tokens/s of the executor with N running requests (contexts
256-512) vs the model's linear layers alone (every projection and the LM head, pure GEMM) at batch N, same
model, dtype and threads, side by side in one run (the linear layers timed between the decode steps). Writes bench/results/roofline.json, `decode_vs_gemm`.

    python bench/roofline.py [--dtype float32] [--kv-cache-dtype auto] [--num-requests 64] [--decode-steps 32]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from executor_svc.costs import linear_layers_seconds  # noqa: E402
from executor_svc.model_runner import ModelRunner  # noqa: E402
from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.step import ExecuteRequest, ExecuteStep  # noqa: E402


def prefill_all(runner: ModelRunner, prompts: list[list[int]], blocks: dict, budget: int) -> dict[str, int]:
    """Prefills every prompt in steps of at most `budget` tokens; returns each request's first sampled token."""
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    last, pending = {}, [(f"r{i}", p) for i, p in enumerate(prompts)]
    while pending:
        step, used = [], 0
        while pending and used + len(pending[0][1]) <= budget:
            request_id, prompt = pending.pop(0)
            step.append(ExecuteRequest(request_id=request_id, token_ids=prompt, start_position=0,
                                       new_block_ids=blocks[request_id], sample=True, sampling_params=params,
                                       prompt_len=len(prompt)))
            used += len(prompt)
        result = runner.execute(ExecuteStep(step, executor_epoch=runner.epoch))
        assert not result.rejected, result.rejected
        last.update({r: t.token_id for r, t in result.sampled.items()})
    return last


def decode_tok_per_s(runner: ModelRunner, prompts, steps: int, budget: int,
                     after_step: Callable[[], None] = lambda: None) -> float:
    """Median decode tokens/s over `steps` steps of every prompt; after_step runs after each (untimed)."""
    bs = runner.block_size
    free = list(range(runner.num_blocks))
    random.Random(0).shuffle(free)  # a shuffled pool, as a long-running server's is
    blocks = {}
    for i, prompt in enumerate(prompts):
        n = -(-(len(prompt) + steps + 1) // bs)
        blocks[f"r{i}"], free = free[:n], free[n:]
    last = prefill_all(runner, prompts, blocks, budget)
    positions = {f"r{i}": len(p) for i, p in enumerate(prompts)}
    times = []
    for _ in range(steps):
        step = ExecuteStep([ExecuteRequest(request_id=r, token_ids=[t], start_position=positions[r], new_block_ids=[],
                                           sample=True) for r, t in last.items()], executor_epoch=runner.epoch)
        start = time.perf_counter()
        result = runner.execute(step)
        times.append(time.perf_counter() - start)
        assert not result.rejected and len(result.sampled) == len(prompts), result.rejected
        last = {r: t.token_id for r, t in result.sampled.items()}
        for r in positions:
            positions[r] += 1
        after_step()
    return len(prompts) / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="auto: as the executor picks it for this CPU")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--name", default="roofline", help="result file name under bench/results/")
    args = parser.parse_args()

    # The default pool (max_num_seqs requests of max_model_len tokens) holds every request's context.
    runner = ModelRunner(ModelConfig(args.model, device="cpu", dtype=args.dtype, attention_backend=args.attention_backend,
                                     max_model_len=512, cpu_threads=args.threads),
                         CacheConfig(kv_cache_dtype=args.kv_cache_dtype), SchedulerConfig(max_num_seqs=args.num_requests))
    rng = random.Random(0)
    # Contexts stay within 256..512 through the decode steps.
    prompts = [[rng.randrange(runner.config.vocab_size) for _ in range(rng.randint(256, 512 - args.decode_steps))]
               for _ in range(args.num_requests)]
    # The linear layers are timed between the decode steps, so that both medians come from the same minutes of
    # a machine whose speed drifts.
    batch, gemm_seconds = args.num_requests, []
    decode = decode_tok_per_s(runner, prompts, args.decode_steps, args.max_num_batched_tokens, after_step=lambda:
                              gemm_seconds.append(linear_layers_seconds(runner.model, batch, batch)))
    gemm = batch / statistics.median(gemm_seconds)
    ratios = {"decode_vs_gemm": decode / gemm}
    metrics = {"decode_tok_per_s": decode, "gemm_tok_per_s": gemm, "num_requests": args.num_requests,
               "decode_steps": args.decode_steps, "dtype": runner.model_config.dtype,
               "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."), "context": [256, 512],
               "attention_backend": runner.attention_backend_name, "torch_threads": torch.get_num_threads()}
    print(f"decode {decode:.1f} tok/s, linear layers alone {gemm:.1f} tok/s, decode_vs_gemm {ratios['decode_vs_gemm']:.3f}")
    print(f"wrote {write_result(args.name, ratios, metrics)}")


if __name__ == "__main__":
    main()
