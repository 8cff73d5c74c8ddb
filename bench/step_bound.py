"""Each engine step against the model's linear layers alone, timed right after it: where the engine spends
more than its linear layers (prefill and mixed steps apart from decode steps), free of the host's drift over
a run, which a bound timed once per run (bench/throughput.py) takes in.

Runs workload W through the in-process engine; after each step, on the thread that ran it, times the linear
layers (executor_svc/costs.py) over that step's token count with the LM head on its sampled rows.
engine_vs_step_bound = the summed bounds / the summed step times (1.0: nothing but the linear layers).
Writes bench/results/step_bound.json.

    python bench/step_bound.py [--dtype float32] [--num-requests 64] [--output-len 64]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import workload_w, write_result  # noqa: E402
from executor_svc.costs import linear_layers_seconds  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--name", default="step_bound", help="result file name under bench/results/")
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(temperature=0, max_tokens=2))  # warm-up
    model, execute = llm.runner.model, llm.runner.execute
    steps = []

    def execute_then_bound(step):
        start = time.perf_counter()
        result = execute(step)
        seconds = time.perf_counter() - start
        num_tokens = sum(len(request.token_ids) for request in step.requests)
        num_sampled = sum(1 for request in step.requests if request.sample)
        bound = linear_layers_seconds(model, num_tokens, 0)
        if num_sampled:
            bound += linear_layers_seconds(model, 0, num_sampled, num_layers=0)
        steps.append({"tokens": num_tokens, "sampled": num_sampled, "rows": len(step.requests),
                      "seconds": seconds, "bound_seconds": bound})
        return result

    llm.runner.execute = execute_then_bound
    prompts = workload_w(args.num_requests)
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
    assert sum(len(r.token_ids) for r in results) == args.num_requests * args.output_len

    def totals(group: list[dict]) -> dict:
        seconds, bound = sum(s["seconds"] for s in group), sum(s["bound_seconds"] for s in group)
        return {"steps": len(group), "seconds": seconds, "bound_seconds": bound,
                "vs_bound": bound / seconds if seconds else None}

    # A decode step has one token per row; any other computes part of a prompt.
    decode = [s for s in steps if s["tokens"] == s["rows"]]
    prefill = [s for s in steps if s["tokens"] != s["rows"]]
    metrics = {"workload": {"num_requests": args.num_requests, "prompt_len": [64, 512], "output_len": args.output_len,
                            "dtype": llm.runner.model_config.dtype},
               "all": totals(steps), "prefill_and_mixed": totals(prefill), "decode": totals(decode), "steps": steps}
    ratios = {"engine_vs_step_bound": metrics["all"]["vs_bound"],
              "prefill_vs_step_bound": metrics["prefill_and_mixed"]["vs_bound"],
              "decode_vs_step_bound": metrics["decode"]["vs_bound"]}
    for name in ("all", "prefill_and_mixed", "decode"):
        part = metrics[name]
        print(f"{name}: {part['steps']} steps, {part['seconds']:.2f} s against {part['bound_seconds']:.2f} s of "
              f"linear layers: {part['vs_bound']:.3f}")
    print(f"wrote {write_result(args.name, ratios, metrics)}")


if __name__ == "__main__":
    main()
