"""Chunked prefill keeps decodes moving: 16 requests decode while a 4096-token prompt arrives, with the
prompt cut into chunks of the token budget (256) versus computed whole in one step. Reports the p99
inter-token latency of the decoding requests from the long prompt's arrival until its first token, and
the long prompt's time to first token, both ways, side by side in one run (the in-process engine, so that
only scheduling differs). Writes bench/results/chunked.json.

    python bench/chunked.py [--long-prompt 4096] [--budget 256] [--decoders 16] [--model default] [--name chunked]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from scheduler_svc.request import Request  # noqa: E402


def run(args, chunked: bool) -> dict:
    budget = args.budget if chunked else args.long_prompt + args.decoders
    llm = LLM(args.model, device="cpu", dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              max_num_batched_tokens=budget, enable_chunked_prefill=chunked, enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.runner.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i in range(args.decoders):
        prompt = [rng.randrange(vocab) for _ in range(64)]
        llm.scheduler.add_request(Request(f"d{i}", prompt, params, llm.eos_token_ids, llm.max_model_len))
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    # Until every decoder has its first token, then a few decode steps to settle.
    while len(last_token) < args.decoders:
        for output in llm.scheduler.step(llm.runner.execute):
            last_token[output.request_id] = time.perf_counter()
    for _ in range(3):
        for output in llm.scheduler.step(llm.runner.execute):
            last_token[output.request_id] = time.perf_counter()
    long_prompt = [rng.randrange(vocab) for _ in range(args.long_prompt)]
    arrival = time.perf_counter()
    llm.scheduler.add_request(Request("long", long_prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                      llm.eos_token_ids, llm.max_model_len))
    first_token = None
    while first_token is None:
        for output in llm.scheduler.step(llm.runner.execute):
            now = time.perf_counter()
            if output.request_id == "long":
                first_token = now
            elif output.new_token_ids:
                gaps.append(now - last_token[output.request_id])
                last_token[output.request_id] = now
    return {
        "budget": budget,
        "p99_itl_ms": float(np.percentile(gaps, 99) * 1e3) if gaps else None,
        "max_itl_ms": float(max(gaps) * 1e3) if gaps else None,
        "itl_samples": len(gaps),
        "long_prompt_ttft_ms": (first_token - arrival) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--long-prompt", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=1024, help="enough to outlast the long prompt")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--name", default="chunked", help="result file name under bench/results/")
    args = parser.parse_args()
    unchunked = run(args, chunked=False)
    chunked = run(args, chunked=True)
    path = write_result(args.name, {
        "p99_itl_chunked_vs_unchunked": round(chunked["p99_itl_ms"] / unchunked["p99_itl_ms"], 4),
        "long_ttft_chunked_vs_unchunked": round(chunked["long_prompt_ttft_ms"] / unchunked["long_prompt_ttft_ms"], 4),
    }, {"chunked": chunked, "unchunked": unchunked, "long_prompt": args.long_prompt, "decoders": args.decoders})
    print(path.read_text())


if __name__ == "__main__":
    main()
