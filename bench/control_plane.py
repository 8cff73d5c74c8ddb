"""The control plane alone: an executor that runs no model and sleeps a fixed time per step
(--benchmark-sleep-ms), 256 running requests through the full stack; the busy fraction is the sleeping
time over the wall time, over a window in which all of them run. Writes bench/results/control_plane.json.

    python bench/control_plane.py [--sleep-ms 5] [--requests 256] [--window 20]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--window", type=float, default=20.0)
    args = parser.parse_args()

    import grpc

    from pagedserve.client import GenerateClient, build_request
    from pagedserve.config import PagedServeConfig
    from pagedserve.entrypoints.launcher import Stack
    from pagedserve.v1 import scheduler_pb2, scheduler_pb2_grpc

    config = PagedServeConfig.from_kwargs(model=args.model, device="cpu", port=0, log_level="WARNING",
                                          benchmark_sleep_ms=args.sleep_ms, max_num_seqs=args.requests,
                                          kv_cache_memory=96 << 30)  # no KV tensors: room for every request
    # Long enough to outlast the window at the rate steps can possibly go.
    max_tokens = int(1.2 * args.window * 1000 / args.sleep_ms) + 100
    with Stack(config) as stack, GenerateClient(stack.address) as client:
        streams = []

        def consume(i: int) -> None:
            stream = client.stream(build_request(prompt_token_ids=[1 + i % 100] * 8, max_tokens=max_tokens,
                                                 ignore_eos=True, temperature=0.0))
            streams.append(stream)
            try:
                for _ in stream:
                    pass
            except grpc.RpcError:
                pass  # cancelled at the end

        threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(args.requests)]
        for thread in threads:
            thread.start()
        with stack.channel("scheduler_svc") as ch:
            scheduler = scheduler_pb2_grpc.SchedulerStub(ch)
            stats = lambda: scheduler.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=10)  # noqa: E731
            while stats().num_running < args.requests:
                time.sleep(0.1)
            start, t0 = stats(), time.perf_counter()
            time.sleep(args.window)
            end, t1 = stats(), time.perf_counter()
        for stream in streams:
            stream.cancel()
    steps = end.num_steps - start.num_steps
    wall = t1 - t0
    busy = steps * args.sleep_ms / 1e3 / wall
    path = write_result("control_plane", {"busy_fraction": round(busy, 4)}, {
        "sleep_ms": args.sleep_ms, "running": args.requests, "steps": steps, "window_s": round(wall, 2),
        "step_ms": round(wall / steps * 1e3, 3) if steps else None,
        "overhead_ms_per_step": round(wall / steps * 1e3 - args.sleep_ms, 3) if steps else None,
    })
    print(path.read_text())


if __name__ == "__main__":
    main()
