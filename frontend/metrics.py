"""The frontend's Prometheus metrics (GET /metrics on the HTTP API), named as vLLM's with the prefix
`pagedserve:` and the label model_name.

Request latencies and token counts are measured here, from the times each request's outputs reach the
frontend (so they include the hop from the scheduler, not the client's network): time to first token, the
time between a request's outputs, time per output token, end-to-end latency, and how each request ended.
The back end's state (running and waiting requests, KV-cache usage, prefix-cache queries and hits,
preemptions) is read from the scheduler when scraped: every frontend of a stack reports the same values.

A frontend fans hundreds of outputs a step out to its streams, so recording one must cost little:
prometheus_client's Histogram.observe and Counter.inc take about 2 µs each (a lock per value, a bucket
search), 1 ms a step at 256 requests. Here an output costs one lock, an append and an addition; the
observations are counted into their buckets when scraped (or once many are pending), and prometheus_client
writes the exposition from the families collect() yields.
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

PREFIX = "pagedserve:"
FINISHED = ("stop", "length")  # the finish reasons of a request that ran to its end
# vLLM's buckets, so that dashboards built for it read these.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
# Pending observations of one histogram are counted into its buckets once there are this many.
FOLD_AT = 4096


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (as vLLM's request token histograms)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class BackendStats:
    """What the scheduler reports of the back end. The KV-cache fields are None when the scheduler could
    not reach the KV-cache service."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float | None = None  # the share of the pool's blocks in use, 0 to 1
    prefix_cache_queries: int | None = None  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int | None = None  # of those, tokens found already computed


@dataclass(slots=True)
class RequestTimes:
    """One request's (one choice's) times on the frontend's clock."""

    arrived: float
    first_token: float | None = None
    last_output: float | None = None
    num_tokens: int = 0
    # As the scheduler timed them (its first output with a token carries them).
    queue_time: float | None = None
    prefill_time: float | None = None


class _Histogram:
    """Observations appended as they come, counted into buckets (upper bounds inclusive, then +Inf) by fold().
    The owner's lock guards both."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...]) -> None:
        self.name, self.documentation, self.bounds = PREFIX + name, documentation, bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.pending: list[float] = []

    def add(self, value: float) -> None:
        self.pending.append(value)
        if len(self.pending) >= FOLD_AT:
            self.fold()

    def fold(self) -> None:
        counts, bounds = self.counts, self.bounds
        for value in self.pending:
            counts[bisect_left(bounds, value)] += 1
        self.sum += sum(self.pending)
        self.pending.clear()

    def family(self, label_names: list[str], label_values: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=label_names)
        buckets, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        family.add_metric(label_values, buckets, self.sum)
        return family


class FrontendMetrics:
    """backend_stats: reads the scheduler's state when scraped (None where it cannot: those metrics are then
    left out of that scrape). Safe from any thread: both APIs' event loops record, a worker thread scrapes."""

    def __init__(self, model_name: str, max_model_len: int,
                 backend_stats: Callable[[], BackendStats | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model_name, self.clock, self.backend_stats = model_name, clock, backend_stats
        self.lock = threading.Lock()
        self.ttft = _Histogram("time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                               TTFT_BUCKETS)
        self.itl = _Histogram("inter_token_latency_seconds",
                              "Time between a request's consecutive outputs (each output one step's tokens).",
                              ITL_BUCKETS)
        self.tpot = _Histogram("request_time_per_output_token_seconds",
                               "(end-to-end latency - time to first token) / (output tokens - 1), per request.",
                               ITL_BUCKETS)
        self.e2e = _Histogram("e2e_request_latency_seconds", "Time from a request's arrival to its last token.",
                              REQUEST_BUCKETS)
        self.queue = _Histogram("request_queue_time_seconds",
                                "Time a request waited in the scheduler's queue before it was first scheduled.",
                                REQUEST_BUCKETS)
        self.prefill = _Histogram("request_prefill_time_seconds",
                                  "Time from a request's first scheduling to its first token.", REQUEST_BUCKETS)
        self.decode = _Histogram("request_decode_time_seconds", "Time from a request's first token to its last.",
                                 REQUEST_BUCKETS)
        self.inference = _Histogram("request_inference_time_seconds",
                                    "Time from a request's first scheduling to its last token (prefill + decode).",
                                    REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens_per_request = _Histogram("request_prompt_tokens", "Prompt tokens of each request.",
                                                    tokens)
        self.generation_tokens_per_request = _Histogram("request_generation_tokens",
                                                        "Output tokens of each request.", tokens)
        self.histograms = (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode,
                           self.inference, self.prompt_tokens_per_request, self.generation_tokens_per_request)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ended: dict[str, int] = {}  # requests by finished_reason
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))

    def arrived(self) -> RequestTimes:
        """A request (one choice of a call) is taken."""
        return RequestTimes(self.clock())

    def prompt(self, num_prompt_tokens: int) -> None:
        """A call's prompt, counted once whatever its n."""
        with self.lock:
            self.prompt_tokens += num_prompt_tokens
            self.prompt_tokens_per_request.add(num_prompt_tokens)

    @staticmethod
    def scheduled(times: RequestTimes, queue_time: float, prefill_time: float) -> None:
        """The scheduler's times of the request, from its first output with a token (kept for its end). Those
        of a request re-submitted to a restarted scheduler after its first token are not its own: ignored."""
        if times.first_token is None:
            times.queue_time, times.prefill_time = queue_time, prefill_time

    def output(self, times: RequestTimes, num_tokens: int) -> None:
        """An output of num_tokens tokens reached the frontend."""
        if num_tokens == 0:
            return
        now = self.clock()
        with self.lock:
            if times.first_token is None:
                times.first_token = now
                self.ttft.add(now - times.arrived)
            else:
                self.itl.add(now - times.last_output)
            self.generation_tokens += num_tokens
        times.last_output = now
        times.num_tokens += num_tokens

    def ended_request(self, times: RequestTimes, finished_reason: str) -> None:
        now = self.clock()
        with self.lock:
            self.ended[finished_reason] = self.ended.get(finished_reason, 0) + 1
            if finished_reason not in FINISHED:  # an aborted or failed request's times say nothing of the serving
                return
            self.e2e.add(now - times.arrived)
            self.generation_tokens_per_request.add(times.num_tokens)
            if times.num_tokens > 1:
                self.tpot.add((now - times.first_token) / (times.num_tokens - 1))
            if times.queue_time is not None and times.first_token is not None:
                self.queue.add(times.queue_time)
                self.prefill.add(times.prefill_time)
                self.decode.add(now - times.first_token)
                self.inference.add(times.prefill_time + now - times.first_token)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)


class _Collector(Collector):
    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self.metrics
        names, values = ["model_name"], [metrics.model_name]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, documentation, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, documentation, labels=names)
            family.add_metric(values, value)
            return family

        with metrics.lock:
            for histogram in metrics.histograms:
                histogram.fold()
            families = [histogram.family(names, values) for histogram in metrics.histograms]
            families.append(counter("prompt_tokens", "Prompt tokens of the requests received.", metrics.prompt_tokens))
            families.append(counter("generation_tokens", "Output tokens sent.", metrics.generation_tokens))
            ended = CounterMetricFamily(PREFIX + "request_success", "Requests ended, by finished_reason (stop, "
                                        "length: finished; abort: the client went away; error, overloaded, "
                                        "unavailable: failed).", labels=[*names, "finished_reason"])
            for reason, count in sorted(metrics.ended.items()):
                ended.add_metric([*values, reason], count)
            families.append(ended)
        yield from families
        stats = metrics.backend_stats() if metrics.backend_stats is not None else None
        if stats is None:
            return
        yield gauge("num_requests_running", "Requests the scheduler is running.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted (preempted ones included).",
                    stats.num_waiting)
        yield counter("num_preemptions", "Running requests preempted for lack of KV-cache blocks.",
                      stats.num_preemptions)
        if stats.kv_cache_usage is not None:
            yield gauge("kv_cache_usage_perc", "The share of the KV-cache pool's blocks in use (0 to 1).",
                        stats.kv_cache_usage)
        if stats.prefix_cache_queries is not None:
            yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          stats.prefix_cache_queries)
            yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
