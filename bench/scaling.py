"""Control-plane scaling over executors: executors that run no model and sleep a fixed time per step
(--benchmark-sleep-ms 5), each with the same batch (--requests-per-executor running requests); the output
tokens streamed back per second with two executors over those with one, same run. The scheduler plans each
step once and sends each executor its part at once, so two executors sleeping side by side should take
about the time of one per step for twice the requests. Writes bench/results/scaling.json.

    python bench/scaling.py [--sleep-ms 5] [--requests-per-executor 16] [--window 10]

The load and the measurement are bench/control_plane.py's (asyncio clients in this process, a window in
which every request runs).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from bench.control_plane import run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--requests-per-executor", type=int, default=16)
    parser.add_argument("--window", type=float, default=10.0)
    args = parser.parse_args()

    runs = {}
    for executors in (1, 2):
        args.requests = executors * args.requests_per_executor
        runs[f"{executors}_executors"] = run(args, async_scheduling=True, executors=executors)
    ratio = runs["2_executors"]["tokens_per_s"] / runs["1_executors"]["tokens_per_s"]
    metrics = {"sleep_ms": args.sleep_ms, "requests_per_executor": args.requests_per_executor, **runs}
    path = write_result("scaling", {"two_vs_one_executor": round(ratio, 3)}, metrics)
    print(path.read_text())


if __name__ == "__main__":
    main()
