"""Soak: a bounded run at fixed concurrency with mixed lengths and random cancels, through the public API
of a stack it starts itself. Reports requests, errors, each service's RSS after warm-up and at the end,
and whether the KV pool is back to idle. Writes bench/results/soak.json.

    python bench/soak.py [--duration 600] [--concurrency 32] [--warmup 60] [--model default]

Every loop is bounded: it stops sending at --duration and waits at most --drain seconds for what is in
flight. Traffic goes only to the stack's loopback addresses.
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402

SERVICES = ("frontend", "scheduler_svc", "kvcache_svc", "executor_svc")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--warmup", type=float, default=120.0,
                        help="seconds before the reference RSS is taken (allocators reach their high-water mark)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(8, 384))
    parser.add_argument("--output-len", type=int, nargs=2, default=(4, 96))
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--sample-every", type=float, default=15.0, help="seconds between RSS samples")
    parser.add_argument("--cancel-fraction", type=float, default=0.15)
    parser.add_argument("--drain", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import grpc

    from pagedserve.client import GenerateClient, build_request
    from pagedserve.config import PagedServeConfig
    from pagedserve.entrypoints.launcher import Stack
    from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc

    config = PagedServeConfig.from_kwargs(model=args.model, device="cpu", port=0, log_level="WARNING",
                                          kv_cache_memory=1 << 30)
    counts = {"completed": 0, "cancelled": 0, "errors": 0, "tokens": 0}
    errors: list[str] = []
    lock = threading.Lock()
    stop_sending = threading.Event()

    with Stack(config) as stack, GenerateClient(stack.address) as client:
        vocab = 49152
        started = time.monotonic()

        def worker(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            while not stop_sending.is_set():
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))]
                max_tokens = rng.randint(*args.output_len)
                cancel_after = rng.randint(1, max_tokens) if rng.random() < args.cancel_fraction else None
                stream = client.stream(build_request(prompt_token_ids=prompt, temperature=rng.choice([0.0, 0.8]),
                                                     seed=rng.randrange(1 << 30), max_tokens=max_tokens,
                                                     ignore_eos=True), timeout=args.request_timeout)
                received, outcome = 0, "completed"
                try:
                    for response in stream:
                        received += len(response.token_ids)
                        if cancel_after is not None and received >= cancel_after:
                            stream.cancel()
                            outcome = "cancelled"
                            break
                except grpc.RpcError as error:
                    outcome = "errors"
                    with lock:
                        errors.append(f"{error.code().name}: {error.details()}")
                with lock:
                    counts[outcome] += 1
                    counts["tokens"] += received

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.concurrency)]
        for thread in threads:
            thread.start()
        time.sleep(args.warmup)
        rss_warm = {name: rss_bytes(stack.processes[name].pid) for name in SERVICES}
        pids = {name: stack.processes[name].pid for name in SERVICES}
        samples = []  # (seconds since start, {service: RSS}) every --sample-every, to tell a leak from a plateau
        while time.monotonic() - started < args.duration:
            time.sleep(min(args.sample_every, max(0.0, args.duration - (time.monotonic() - started))))
            samples.append((round(time.monotonic() - started), {n: rss_bytes(stack.processes[n].pid) for n in SERVICES}))
        stop_sending.set()
        for thread in threads:
            thread.join(timeout=args.drain)
        rss_end = {name: rss_bytes(stack.processes[name].pid) for name in SERVICES}
        restarted = [name for name in SERVICES if stack.processes[name].pid != pids[name]]
        with stack.channel("kvcache_svc") as ch:
            kv = kvcache_pb2_grpc.KVCacheStub(ch)
            deadline = time.monotonic() + 30
            while True:  # the last finished requests' blocks come back with the scheduler's next step
                pool = kv.GetStats(kvcache_pb2.KVCacheStatsRequest(), timeout=5)
                if (pool.num_requests == 0 and pool.num_in_use == 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        wall = time.monotonic() - started

    growth = {name: rss_end[name] / rss_warm[name] for name in SERVICES}
    path = write_result("soak", {"max_rss_growth": round(max(growth.values()), 4)}, {
        "duration_s": round(wall, 1), "concurrency": args.concurrency, **counts,
        "error_samples": errors[:10], "services_restarted": restarted,
        "rss_after_warmup_mib": {k: round(v / 2**20, 1) for k, v in rss_warm.items()},
        "rss_at_end_mib": {k: round(v / 2**20, 1) for k, v in rss_end.items()},
        "rss_growth": {k: round(v, 4) for k, v in growth.items()},
        "rss_samples_mib": [[t, {k: round(v / 2**20, 1) for k, v in rss.items()}] for t, rss in samples],
        "kv_idle_at_end": pool.num_requests == 0 and pool.num_in_use == 0,
        "kv_in_use_at_end": pool.num_in_use, "kv_requests_at_end": pool.num_requests,
    })
    print(path.read_text())


if __name__ == "__main__":
    main()
