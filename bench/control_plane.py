"""The control plane alone: an executor that runs no model and sleeps a fixed time per step
(--benchmark-sleep-ms), 256 running requests through the full stack; the busy fraction is the sleeping
time over the wall time, over a window in which all of them run. The same load runs with steps planned
ahead (the default) and without (--no-async-scheduling), and with steps planned ahead and each stream interval
asked for (--stream-interval N: the scheduler sends a request's tokens N at a time), side by side; each run
also records the CPU each process spent per step. With --control-plane-cpus, the runs with steps planned ahead
are repeated with the scheduler and the KV-cache service on those CPUs and the rest of the stack, the load
generator too, on the others (`pagedserve up --control-plane-cpus`). With --frontend-nice, the run with
steps planned ahead is repeated last with the frontend at that nice (`pagedserve up --frontend-nice`) and the
clients' thread at --clients-nice, as clients on other machines would take none of these cores (last, since
a thread cannot take back the priority it gave up). Writes bench/results/control_plane.json.

    python bench/control_plane.py [--sleep-ms 5] [--requests 256] [--window 20] [--only-async]
                                  [--stream-intervals 4,16] [--control-plane-cpus 0]
                                  [--frontend-nice 10 [--clients-nice 19]] [--api grpc|http] [--name control_plane]

With --api http the clients stream completions from the OpenAI API as server-sent events instead (httpx, on
the same one thread); messages_per_step then counts events.

The clients are asyncio streams on one thread of this process, so that the load generator takes as little of
the machine's cores as it can (its CPU is recorded too).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@functools.cache
def clients_loop() -> asyncio.AbstractEventLoop:
    """The one event loop of every run's clients: gRPC's asyncio layer stays bound to the loop it started on
    while any of its objects lives, so that a run's clients on a new loop could wait forever."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="clients", daemon=True)
    thread.start()
    loop.clients_thread_id = thread.native_id
    return loop


def run(args, async_scheduling: bool, executors: int = 1, stream_interval: int = 1,
        control_plane_cpus: str | None = None, frontend_nice: int | None = None) -> dict:
    """args.requests streams on a stack of `executors` sleeping executors, measured over args.window seconds
    once all of them run."""
    import grpc
    import httpx

    from pagedserve.client import build_request
    from pagedserve.config import PagedServeConfig, format_cpu_list
    from pagedserve.entrypoints.launcher import Stack
    from pagedserve.service import pin_to_cpus
    from pagedserve.v1 import generate_pb2, generate_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

    config = PagedServeConfig.from_kwargs(model=args.model, device="cpu", port=0, log_level="WARNING",
                                          benchmark_sleep_ms=args.sleep_ms, max_num_seqs=args.requests,
                                          async_scheduling=async_scheduling, executors=executors,
                                          stream_interval=stream_interval, control_plane_cpus=control_plane_cpus,
                                          frontend_nice=frontend_nice,
                                          kv_cache_memory=96 << 30)  # no KV tensors: room for every request
    prompt_len = 8
    own_cpus = format_cpu_list(os.sched_getaffinity(0))
    with Stack(config) as stack:
        loop = clients_loop()
        stop = asyncio.Event()
        received = [0, 0]  # tokens and messages streamed back so far

        async def consume(stub, i: int, max_tokens: int) -> None:
            request = build_request(prompt_token_ids=[1 + i % 100] * prompt_len, max_tokens=max_tokens,
                                    ignore_eos=True, temperature=0.0)
            async for response in stub.Generate(request):
                received[0] += len(response.token_ids)
                received[1] += 1

        async def consume_http(client, i: int, max_tokens: int) -> None:
            body = {"prompt": [1 + i % 100] * prompt_len, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0.0, "stream": True}
            async with client.stream("POST", f"{stack.http_url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):  # (an event's tokens are not counted: that takes parsing it)
                        received[1] += 1

        async def load() -> None:
            async with grpc.aio.insecure_channel(stack.address) as channel, \
                    httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=args.requests)) as client:
                stub = generate_pb2_grpc.GenerationStub(channel)
                info = await stub.GetModelInfo(generate_pb2.ModelInfoRequest(), timeout=60)
                # Long enough to outlast the window at the rate steps can possibly go (within the context).
                max_tokens = min(int(1.2 * args.window * 1000 / args.sleep_ms) + 100, info.max_model_len - prompt_len)
                streams = [asyncio.ensure_future(consume_http(client, i, max_tokens) if args.api == "http"
                                                 else consume(stub, i, max_tokens)) for i in range(args.requests)]
                await stop.wait()
                for stream in streams:
                    stream.cancel()
                await asyncio.gather(*streams, return_exceptions=True)

        if control_plane_cpus is not None:  # the clients (and gRPC's threads that carry them) stand for remote ones
            pin_to_cpus(stack.cpus["frontend"])
        clients = asyncio.run_coroutine_threadsafe(load(), loop)
        pids = {name: process.pid for name, process in stack.processes.items()}
        with stack.channel("scheduler_svc") as ch:
            scheduler = scheduler_pb2_grpc.SchedulerStub(ch)
            stats = lambda: scheduler.GetStats(scheduler_pb2.SchedulerStatsRequest(), timeout=10)  # noqa: E731
            while stats().num_running < args.requests:
                time.sleep(0.1)
            cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"clients": time.process_time()}
            start, (tokens0, messages0), t0 = stats(), list(received), time.perf_counter()
            time.sleep(args.window)
            end, (tokens1, messages1), t1 = stats(), list(received), time.perf_counter()
            cpu1 = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"clients": time.process_time()}
        loop.call_soon_threadsafe(stop.set)
        clients.result(timeout=60)
    pin_to_cpus(own_cpus)  # the next run's stack starts from all of them again
    steps = end.num_steps - start.num_steps
    wall = t1 - t0
    return {
        "busy_fraction": round(steps * args.sleep_ms / 1e3 / wall, 4),
        "steps": steps, "window_s": round(wall, 2),
        "tokens_per_s": round((tokens1 - tokens0) / wall, 1) if args.api == "grpc" else None,
        "step_ms": round(wall / steps * 1e3, 3) if steps else None,
        # Fewer than the running requests when the frontend or a client falls behind and joins steps' tokens.
        "messages_per_step": round((messages1 - messages0) / steps, 1) if steps else None,
        "overhead_ms_per_step": round(wall / steps * 1e3 - args.sleep_ms, 3) if steps else None,
        # The engine loop's depth at the window's end, and the running share of its own work that chose it.
        "steps_out_limit": end.steps_out_limit, "loop_work_share": round(end.loop_work_share, 3),
        # Calls to the KV-cache service per step (fewer than one: steps planned on slots reserved ahead).
        "kv_calls_per_step": round((end.kv_rpcs - start.kv_rpcs) / steps, 3) if steps else None,
        "cpu_ms_per_step": {name: round((cpu1[name] - cpu0[name]) / steps * 1e3, 3) if steps else None
                            for name in cpu0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--only-async", action="store_true", help="skip the run without async scheduling")
    parser.add_argument("--stream-intervals", default="4,16",
                        help="comma-separated stream intervals to run besides 1 (empty: none)")
    parser.add_argument("--control-plane-cpus", default=None,
                        help="also run the planned-ahead runs with the scheduler and the KV-cache service on these "
                             "CPUs, the rest of the stack and the clients on the others")
    parser.add_argument("--frontend-nice", type=int, default=None,
                        help="also run the planned-ahead load (last) with the frontend at this nice")
    parser.add_argument("--clients-nice", type=int, default=19,
                        help="the clients' thread's nice in that run (it keeps it: the run comes last)")
    parser.add_argument("--api", default="grpc", choices=["grpc", "http"],
                        help="the clients' API: gRPC Generate streams, or the OpenAI API's server-sent events")
    parser.add_argument("--name", default="control_plane", help="result file name under bench/results/")
    args = parser.parse_args()

    metrics = {"sleep_ms": args.sleep_ms, "running": args.requests, "control_plane_cpus": args.control_plane_cpus,
               "api": args.api}
    ratios = {}

    def pin(interval: int) -> None:
        """With --control-plane-cpus, the same run pinned, right after the unpinned one (the host drifts)."""
        if args.control_plane_cpus is not None:
            pinned = run(args, async_scheduling=True, stream_interval=interval,
                         control_plane_cpus=args.control_plane_cpus)
            metrics[f"control_plane_cpus_stream_interval_{interval}"] = pinned
            suffix = "" if interval == 1 else f"_stream_interval_{interval}"
            ratios[f"busy_fraction{suffix}_control_plane_cpus"] = pinned["busy_fraction"]

    planned_ahead = run(args, async_scheduling=True)
    metrics["async_scheduling"] = planned_ahead
    ratios["busy_fraction"] = planned_ahead["busy_fraction"]
    pin(1)
    if not args.only_async:
        one_at_a_time = run(args, async_scheduling=False)
        metrics["sync_scheduling"] = one_at_a_time
        ratios["async_vs_sync_steps_per_s"] = round(
            planned_ahead["steps"] / planned_ahead["window_s"] / (one_at_a_time["steps"] / one_at_a_time["window_s"]), 3)
    intervals = [int(n) for n in args.stream_intervals.split(",") if n]
    for interval in intervals:
        batched = run(args, async_scheduling=True, stream_interval=interval)
        metrics[f"stream_interval_{interval}"] = batched
        ratios[f"busy_fraction_stream_interval_{interval}"] = batched["busy_fraction"]
        pin(interval)
    if args.frontend_nice is not None:
        os.setpriority(os.PRIO_PROCESS, clients_loop().clients_thread_id, args.clients_nice)
        prioritized = run(args, async_scheduling=True, frontend_nice=args.frontend_nice)
        metrics["frontend_nice"] = prioritized | {"frontend_nice": args.frontend_nice, "clients_nice": args.clients_nice}
        ratios["busy_fraction_frontend_nice"] = prioritized["busy_fraction"]
    path = write_result(args.name, ratios, metrics)
    print(path.read_text())


if __name__ == "__main__":
    main()
