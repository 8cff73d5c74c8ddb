"""Where a step's time goes: the torch profiler over decode steps (N running requests, contexts 256-512) and
mixed steps (the same decodes plus a prefill chunk), on the executor as it serves. Prints the operator
tables and writes bench/results/profile.json (the top operators' shares of CPU time).

    python bench/profile_step.py [--dtype float32] [--num-requests 64] [--steps 4] [--chunk 512]
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from bench.roofline import prefill_all  # noqa: E402
from executor_svc.model_runner import ModelRunner  # noqa: E402
from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.step import ExecuteRequest, ExecuteStep  # noqa: E402


def top_ops(prof, limit: int) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "self_cpu_share": e.self_cpu_time_total / total, "calls": e.count} for e in events[:limit]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens in each mixed step")
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--name", default="profile", help="result file name under bench/results/")
    args = parser.parse_args()

    # The default pool (max_num_seqs requests of max_model_len tokens) holds every request's context.
    runner = ModelRunner(ModelConfig(args.model, device="cpu", dtype=args.dtype, attention_backend=args.attention_backend,
                                     max_model_len=max(512, args.chunk * args.steps), cpu_threads=args.threads),
                         CacheConfig(), SchedulerConfig(max_num_seqs=args.num_requests + 1))
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(256, 512 - 2 * args.steps - 1))]
               for _ in range(args.num_requests)]
    bs, free = runner.block_size, list(range(runner.num_blocks))
    rng.shuffle(free)
    blocks = {}
    for i, prompt in enumerate(prompts):
        n = -(-(len(prompt) + 2 * args.steps + 1) // bs)
        blocks[f"r{i}"], free = free[:n], free[n:]
    last = prefill_all(runner, prompts, blocks, 2048)
    positions = {f"r{i}": len(p) for i, p in enumerate(prompts)}
    long_prompt = [rng.randrange(vocab) for _ in range(args.chunk * args.steps)]
    long_blocks = free[: -(-len(long_prompt) // bs)]

    def decodes() -> list[ExecuteRequest]:
        return [ExecuteRequest(request_id=r, token_ids=[t], start_position=positions[r], new_block_ids=[], sample=True)
                for r, t in last.items()]

    def run(step: ExecuteStep) -> None:
        nonlocal last
        result = runner.execute(step)
        assert not result.rejected, result.rejected
        last = {r: t.token_id for r, t in result.sampled.items() if r in positions}
        for r in positions:
            positions[r] += 1

    run(ExecuteStep(decodes(), executor_epoch=runner.epoch))  # warm-up
    tables, metrics = {}, {"num_requests": args.num_requests, "chunk": args.chunk, "dtype": runner.model_config.dtype,
                           "attention_backend": runner.attention_backend_name, "torch_threads": torch.get_num_threads()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            run(ExecuteStep(decodes(), executor_epoch=runner.epoch))
    tables["decode"] = prof
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(args.steps):
            chunk = ExecuteRequest(request_id="long", token_ids=long_prompt[i * args.chunk : (i + 1) * args.chunk],
                                   start_position=i * args.chunk, new_block_ids=long_blocks if i == 0 else [],
                                   sample=i == args.steps - 1, sampling_params=params if i == 0 else None,
                                   prompt_len=len(long_prompt))
            run(ExecuteStep([chunk] + decodes(), executor_epoch=runner.epoch))
    tables["mixed"] = prof
    for name, prof in tables.items():
        print(f"\n{name} steps ({args.num_requests} decodes{f' + a {args.chunk}-token chunk' if name == 'mixed' else ''}"
              f", {args.steps} steps):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        metrics[name] = {"total_s": sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6 / args.steps,
                         "top_ops": top_ops(prof, args.rows)}
    print(f"wrote {write_result(args.name, {}, metrics)}")


if __name__ == "__main__":
    main()
