"""Serving benchmark through the public gRPC API, in the manner of `vllm bench serve`.

Sends workload W (by default 64 requests of random prompt token ids, lengths uniform in [64, 512],
exactly 64 greedy output tokens each, all at once) to a running server, or to a stack it starts and
stops itself, one thread per request on one shared channel. Reports TTFT, TPOT, ITL and end-to-end
latency (mean, p50, p90, p99, in ms) and request, output-token and total-token throughput over the
benchmark's wall time (first send to last finish). Writes bench/results/<name>.json.

    python bench/serve.py [--address HOST:PORT] [--num-requests 64] [--output-len 64]
                          [--request-rate inf] [--max-concurrency N] [--seed 0] [--name serve]

Definitions (vLLM's): TTFT = first token-carrying message - send; ITL = gaps between successive
token-carrying messages (a message may carry several tokens), pooled over all requests; TPOT per
request = (e2e - TTFT) / (output tokens - 1); e2e = last message - send.

Prefix caching: a server keeps the blocks of earlier runs, so repeating the same seeded prompts against
a long-running server would skip their prefill. Every run therefore sends a fresh cache salt (its
requests still share blocks among themselves); `--cache-salt ""` sends none.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import workload_w, write_result  # noqa: E402

W_PROMPT_LEN = (64, 512)
W_VOCAB_SIZE = 49152
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4
PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------------------------------------------
# Pure helpers: arrivals, per-request metrics, statistics (unit-tested without a server).


@dataclass
class RequestRecord:
    """What one request saw, in time.perf_counter() seconds."""

    prompt_len: int
    send_time: float | None = None
    message_times: list[float] = field(default_factory=list)  # arrival of each token-carrying message
    message_tokens: list[int] = field(default_factory=list)   # tokens in each of those messages
    finish_time: float | None = None  # the last message, or the error
    finish_reason: int = 0
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.message_tokens)


@dataclass
class RequestMetrics:
    ttft: float
    e2e: float
    tpot: float | None  # None with a single output token
    itls: list[float]


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times relative to the start: all 0 at rate inf, else a Poisson process (exponential gaps)
    whose first request goes at 0."""
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    rng = random.Random(seed)
    offsets = [0.0]
    for _ in range(num_requests - 1):
        offsets.append(offsets[-1] + rng.expovariate(request_rate))
    return offsets


def request_metrics(record: RequestRecord) -> RequestMetrics:
    """TTFT, e2e, TPOT and the inter-message gaps of one completed request (seconds)."""
    if record.error is not None or record.send_time is None or record.finish_time is None:
        raise ValueError("request_metrics needs a completed request")
    if not record.message_times:
        raise ValueError("a completed request has at least one token-carrying message")
    ttft = record.message_times[0] - record.send_time
    e2e = record.finish_time - record.send_time
    n = record.output_tokens
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    times = record.message_times
    itls = [later - earlier for earlier, later in zip(times, times[1:])]
    return RequestMetrics(ttft=ttft, e2e=e2e, tpot=tpot, itls=itls)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default);
    None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats_ms(values_s: list[float]) -> dict:
    """mean, p50, p90, p99 of values in seconds, in milliseconds (None when there are none)."""
    stats = {"mean": sum(values_s) / len(values_s) * 1e3 if values_s else None}
    for q in PERCENTILES:
        value = percentile(values_s, q)
        stats[f"p{q}"] = value * 1e3 if value is not None else None
    stats["count"] = len(values_s)
    return stats


def summarize(records: list[RequestRecord], output_len: int | None = None) -> dict:
    """Benchmark metrics from all records: counts, throughputs over first send to last finish, and
    the latency distributions of the completed requests."""
    completed = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    sends = [r.send_time for r in records if r.send_time is not None]
    ends = [r.finish_time for r in records if r.finish_time is not None]
    duration = max(ends) - min(sends) if sends and ends else 0.0

    per_request = [request_metrics(r) for r in completed]
    input_tokens = sum(r.prompt_len for r in completed)
    output_tokens = sum(r.output_tokens for r in completed)

    def rate(amount: float) -> float | None:
        return amount / duration if duration > 0 else None

    metrics = {
        "completed": len(completed),
        "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": rate(len(completed)),
        "output_tok_per_s": rate(output_tokens),
        "total_tok_per_s": rate(input_tokens + output_tokens),
        "ttft_ms": stats_ms([m.ttft for m in per_request]),
        "tpot_ms": stats_ms([m.tpot for m in per_request if m.tpot is not None]),
        "itl_ms": stats_ms([gap for m in per_request for gap in m.itls]),
        "e2e_ms": stats_ms([m.e2e for m in per_request]),
    }
    if output_len is not None:
        metrics["output_len_mismatches"] = sum(r.output_tokens != output_len for r in completed)
    return metrics


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(metrics: dict, title: str) -> str:
    """The compact table printed at the end of a run."""
    server = metrics["server"]
    workload = metrics["workload"]
    if server["started_by_benchmark"]:
        where = (f"{server['address']} (started here: {server['model']}, {server['dtype']}, "
                 f"{server['device']}, kv {server['kv_cache_memory']} B)")
    else:
        where = f"{server['address']} (running server)"
    concurrency = workload["max_concurrency"] or "unlimited"
    lines = [
        f"{'=' * 20} {title} {'=' * 20}",
        f"server              {where}; model {server['served_model']}",
        f"workload            {workload['num_requests']} requests, prompts {workload['prompt_len'][0]}-"
        f"{workload['prompt_len'][1]} tokens, {workload['output_len']} output tokens, "
        f"rate {workload['request_rate']} req/s, concurrency {concurrency}",
        f"requests            {metrics['completed']} completed, {metrics['failed']} failed",
    ]
    for error, count in metrics["errors"].items():
        lines.append(f"  error x{count}: {error}")
    if metrics.get("output_len_mismatches"):
        lines.append(f"  warning: {metrics['output_len_mismatches']} completed requests did not produce "
                     f"exactly {workload['output_len']} tokens")
    lines += [
        f"duration            {metrics['duration_s']:.2f} s",
        f"tokens              {metrics['total_input_tokens']} input, {metrics['total_output_tokens']} output",
        f"request throughput  {_fmt(metrics['request_throughput'], '.3f')} req/s",
        f"output throughput   {_fmt(metrics['output_tok_per_s'], '.2f')} tok/s",
        f"total throughput    {_fmt(metrics['total_tok_per_s'], '.2f')} tok/s",
        f"{'(ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        s = metrics[key]
        lines.append(f"{label:<12}" + "".join(f"{_fmt(s[k], '.1f'):>10}" for k in ("mean", "p50", "p90", "p99")))
    lines.append("=" * (42 + len(title)))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Driving the server.


def run_request(client, request, record: RequestRecord, semaphore: threading.Semaphore | None,
                timeout: float | None) -> None:
    """Streams one request and fills its record; every failure ends up in record.error."""
    import grpc

    if semaphore is not None:
        semaphore.acquire()
    try:
        record.send_time = time.perf_counter()
        for response in client.stream(request, timeout=timeout):
            now = time.perf_counter()
            if response.token_ids:
                record.message_times.append(now)
                record.message_tokens.append(len(response.token_ids))
            if response.finish_reason:
                record.finish_time = now
                record.finish_reason = response.finish_reason
                break
        else:
            record.finish_time = time.perf_counter()
            record.error = "stream ended without a finish reason"
            return
        if not record.message_tokens:
            record.error = "finished without output tokens"
    except grpc.RpcError as error:
        record.finish_time = time.perf_counter()
        record.error = f"{error.code().name}: {error.details()}"
    except Exception as error:  # noqa: BLE001 - a benchmark counts every failure, whatever its kind
        record.finish_time = time.perf_counter()
        record.error = f"{type(error).__name__}: {error}"
    finally:
        if semaphore is not None:
            semaphore.release()


def run_benchmark(client, prompts: list[list[int]], args, cache_salt: str) -> list[RequestRecord]:
    from pagedserve.client import build_request

    run_id = uuid.uuid4().hex[:8]
    records = [RequestRecord(prompt_len=len(p)) for p in prompts]
    requests = [
        build_request(prompt_token_ids=p, request_id=f"bench-serve-{run_id}-{i}", cache_salt=cache_salt,
                      max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        for i, p in enumerate(prompts)
    ]
    offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
    semaphore = threading.Semaphore(args.max_concurrency) if args.max_concurrency else None
    threads = []
    start = time.perf_counter()
    for request, record, offset in zip(requests, records, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=run_request, args=(client, request, record, semaphore,
                                                            args.request_timeout), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return records


def warm_up(client, count: int, vocab_size: int, seed: int, cache_salt: str) -> None:
    """A few short requests on prompts unrelated to the workload's; raises if any fails."""
    from pagedserve.client import build_request

    rng = random.Random(f"warmup-{seed}")
    for i in range(count):
        prompt = [rng.randrange(vocab_size) for _ in range(WARMUP_PROMPT_LEN)]
        completion = client.generate(build_request(
            prompt_token_ids=prompt, cache_salt=cache_salt, max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True,
            temperature=0.0))
        if len(completion.token_ids) != WARMUP_OUTPUT_LEN:
            raise RuntimeError(f"warm-up request {i} returned {len(completion.token_ids)} tokens, "
                               f"expected {WARMUP_OUTPUT_LEN}")


def benchmark_against(address: str, args, server: dict) -> dict:
    from pagedserve.client import GenerateClient
    from pagedserve.v1 import generate_pb2

    cache_salt = f"bench-serve-{uuid.uuid4().hex}" if args.cache_salt is None else args.cache_salt
    with GenerateClient(address) as client:
        info = client.generation.GetModelInfo(generate_pb2.ModelInfoRequest(), timeout=60, wait_for_ready=True)
        vocab_size = min(W_VOCAB_SIZE, info.vocab_size)
        prompts = workload_w(args.num_requests, *W_PROMPT_LEN, vocab_size=vocab_size, seed=args.seed)
        warm_up(client, args.warmup_requests, vocab_size, args.seed, cache_salt)
        records = run_benchmark(client, prompts, args, cache_salt)
    workload = {
        "num_requests": args.num_requests, "prompt_len": list(W_PROMPT_LEN), "output_len": args.output_len,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "seed": args.seed, "vocab_size": vocab_size,
        "warmup_requests": args.warmup_requests, "cache_salt": cache_salt,
        "sampling": {"temperature": 0.0, "ignore_eos": True, "max_tokens": args.output_len},
    }
    server = {**server, "address": address, "served_model": info.model, "max_model_len": info.max_model_len,
              "vocab_size": info.vocab_size}
    return {"workload": workload, "server": server, **summarize(records, args.output_len)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="host:port of a running server's public API "
                                          "(default: start a stack here and stop it at the end)")
    own = parser.add_argument_group("the stack started here (ignored with --address)")
    own.add_argument("--model", default="default")
    own.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    own.add_argument("--device", default="cpu")
    own.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes (default 2 GiB)")
    own.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests/s, Poisson arrivals; inf (default) sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    parser.add_argument("--warmup-requests", type=int, default=1, help="short requests sent first, not measured")
    parser.add_argument("--request-timeout", type=float, default=None, help="seconds per request (default none)")
    parser.add_argument("--cache-salt", default=None,
                        help="prefix-cache salt of every request (default: a fresh one per run)")
    parser.add_argument("--name", default="serve", help="result file name under bench/results/")
    args = parser.parse_args(argv)
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    if args.output_len < 1:
        parser.error("--output-len must be at least 1")
    if not args.request_rate > 0:
        parser.error("--request-rate must be positive (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    if args.warmup_requests < 0:
        parser.error("--warmup-requests must not be negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.address:
        metrics = benchmark_against(args.address, args, {
            "started_by_benchmark": False, "model": None, "dtype": None, "device": None,
            "kv_cache_memory": None, "max_num_batched_tokens": None,
        })
    else:
        from pagedserve.config import PagedServeConfig
        from pagedserve.entrypoints.launcher import Stack

        config = PagedServeConfig.from_kwargs(model=args.model, device=args.device, dtype=args.dtype, port=0,
                                              kv_cache_memory=args.kv_cache_memory,
                                              max_num_batched_tokens=args.max_num_batched_tokens)
        print(f"starting the stack ({args.model}, {args.dtype}, {args.device}, kv {args.kv_cache_memory} B)...",
              flush=True)
        started = time.perf_counter()
        with Stack(config) as stack:
            startup_s = time.perf_counter() - started
            print(f"stack serving on {stack.address} after {startup_s:.1f} s", flush=True)
            metrics = benchmark_against(stack.address, args, {
                "started_by_benchmark": True, "model": args.model, "dtype": args.dtype, "device": args.device,
                "kv_cache_memory": args.kv_cache_memory, "max_num_batched_tokens": args.max_num_batched_tokens,
                "startup_s": startup_s,
            })
    print(format_report(metrics, f"serving benchmark: {args.name}"))
    path = write_result(args.name, {}, metrics)
    print(f"wrote {path}")
    return 1 if metrics["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
