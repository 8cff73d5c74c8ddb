"""Control-plane scaling over executors: executors that run no model and sleep a fixed time per step
(--benchmark-sleep-ms 5), each with the same batch (--requests-per-executor running requests); the output
tokens streamed back per second with two executors over those with one, same run (the medians of rounds
that alternate the two). The scheduler plans each
step once and sends each executor its part at once, so two executors sleeping side by side should take
about the time of one per step for twice the requests. Writes bench/results/scaling.json.

    python bench/scaling.py [--sleep-ms 5] [--requests-per-executor 8] [--window 10] [--rounds 3]

The load and the measurement are bench/control_plane.py's (asyncio clients in this process, a window in
which every request runs).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from bench.control_plane import run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--requests-per-executor", type=int, default=8)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    # Rounds alternate the two topologies, so that a neighbour's load on the machine falls on both alike.
    runs = {"1_executors": [], "2_executors": []}
    for _ in range(args.rounds):
        for executors in (1, 2):
            args.requests = executors * args.requests_per_executor
            runs[f"{executors}_executors"].append(run(args, async_scheduling=True, executors=executors))
    median = {name: statistics.median(r["tokens_per_s"] for r in rounds) for name, rounds in runs.items()}
    ratio = median["2_executors"] / median["1_executors"]
    metrics = {"sleep_ms": args.sleep_ms, "requests_per_executor": args.requests_per_executor,
               "median_tokens_per_s": median, **runs}
    path = write_result("scaling", {"two_vs_one_executor": round(ratio, 3)}, metrics)
    print(path.read_text())


if __name__ == "__main__":
    main()
