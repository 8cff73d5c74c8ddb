"""bench/serve.py's pure parts: arrivals, per-request metrics, percentiles, the summary, and the request
loop against a fake client (no server)."""
from __future__ import annotations

import argparse
import math
import random
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from bench import serve
from bench.serve import RequestRecord, arrival_offsets, percentile, request_metrics, stats_ms, summarize


# --- percentiles ----------------------------------------------------------------------------------

def test_percentile_interpolates_linearly_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == pytest.approx(2.5)   # rank 1.5
    assert percentile(values, 90) == pytest.approx(3.7)   # rank 2.7
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile(values, 100) == 4.0


def test_percentile_of_one_and_of_none():
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_stats_ms_converts_seconds():
    stats = stats_ms([0.1, 0.2, 0.3])
    assert stats["mean"] == pytest.approx(200.0)
    assert stats["p50"] == pytest.approx(200.0)
    assert stats["p90"] == pytest.approx(280.0)  # rank 1.8
    assert stats["p99"] == pytest.approx(298.0)  # rank 1.98
    assert stats["count"] == 3
    assert stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}


# --- one request ----------------------------------------------------------------------------------

def test_request_metrics_counts_tokens_and_uses_message_gaps():
    record = RequestRecord(prompt_len=100, send_time=10.0, message_times=[10.5, 10.7, 11.0],
                           message_tokens=[1, 2, 1], finish_time=11.0, finish_reason=2)
    m = request_metrics(record)
    assert record.output_tokens == 4
    assert m.ttft == pytest.approx(0.5)
    assert m.e2e == pytest.approx(1.0)
    assert m.tpot == pytest.approx(0.5 / 3)  # (e2e - ttft) / (4 - 1)
    assert m.itls == pytest.approx([0.2, 0.3])  # gaps between messages, not per token


def test_request_metrics_single_token_has_no_tpot():
    record = RequestRecord(prompt_len=8, send_time=1.0, message_times=[1.25], message_tokens=[1],
                           finish_time=1.25, finish_reason=2)
    m = request_metrics(record)
    assert m.ttft == pytest.approx(0.25)
    assert m.tpot is None
    assert m.itls == []


def test_request_metrics_rejects_a_failed_request():
    with pytest.raises(ValueError):
        request_metrics(RequestRecord(prompt_len=8, send_time=0.0, finish_time=1.0, error="UNAVAILABLE: gone"))


# --- the summary ----------------------------------------------------------------------------------

def three_records() -> list[RequestRecord]:
    a = RequestRecord(prompt_len=100, send_time=0.0, message_times=[0.5, 0.7, 1.0], message_tokens=[1, 2, 1],
                      finish_time=1.0, finish_reason=2)
    b = RequestRecord(prompt_len=50, send_time=0.2, message_times=[0.4, 0.6], message_tokens=[1, 1],
                      finish_time=0.6, finish_reason=2)
    c = RequestRecord(prompt_len=70, send_time=0.1, finish_time=2.0, error="UNAVAILABLE: connection reset")
    return [a, b, c]


def test_summarize_hand_computed():
    m = summarize(three_records(), output_len=4)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["errors"] == {"UNAVAILABLE: connection reset": 1}
    assert m["duration_s"] == pytest.approx(2.0)  # first send (0.0) to the last end, failed ones included
    assert m["total_input_tokens"] == 150  # completed requests only
    assert m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_tok_per_s"] == pytest.approx(3.0)
    assert m["total_tok_per_s"] == pytest.approx(78.0)
    # TTFT: 0.5 and 0.2 s
    assert m["ttft_ms"]["mean"] == pytest.approx(350.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(350.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(470.0)
    assert m["ttft_ms"]["p99"] == pytest.approx(497.0)
    # TPOT: (1.0 - 0.5) / 3 and (0.4 - 0.2) / 1
    assert m["tpot_ms"]["mean"] == pytest.approx((500 / 3 + 200) / 2)
    # ITL pooled over requests: 0.2, 0.3 (a) and 0.2 (b)
    assert m["itl_ms"]["count"] == 3
    assert m["itl_ms"]["mean"] == pytest.approx(700 / 3)
    assert m["itl_ms"]["p50"] == pytest.approx(200.0)
    assert m["itl_ms"]["p90"] == pytest.approx(280.0)
    assert m["itl_ms"]["p99"] == pytest.approx(298.0)
    # E2E: 1.0 and 0.4 s
    assert m["e2e_ms"]["mean"] == pytest.approx(700.0)
    assert m["output_len_mismatches"] == 1  # b made 2 tokens, not 4


def test_summarize_all_failed_reports_no_latencies():
    m = summarize([RequestRecord(prompt_len=10, send_time=0.0, finish_time=0.5, error="boom")] * 2)
    assert (m["completed"], m["failed"]) == (0, 2)
    assert m["errors"] == {"boom": 2}
    assert m["output_tok_per_s"] == 0.0
    assert m["ttft_ms"]["mean"] is None and m["itl_ms"]["p99"] is None


# --- arrivals -------------------------------------------------------------------------------------

def test_arrivals_all_at_once_at_rate_inf():
    assert arrival_offsets(4, math.inf, seed=0) == [0.0, 0.0, 0.0, 0.0]
    assert arrival_offsets(0, 2.0, seed=0) == []


def test_arrivals_poisson_gaps_are_seeded_exponentials():
    offsets = arrival_offsets(3, 4.0, seed=7)
    rng = random.Random(7)
    first, second = rng.expovariate(4.0), rng.expovariate(4.0)
    assert offsets == pytest.approx([0.0, first, first + second])
    assert arrival_offsets(3, 4.0, seed=7) == offsets
    assert arrival_offsets(3, 4.0, seed=8) != offsets


def test_arrivals_mean_gap_is_one_over_rate():
    offsets = arrival_offsets(20001, 4.0, seed=1)
    assert offsets[-1] / 20000 == pytest.approx(0.25, rel=0.03)
    assert all(later >= earlier for earlier, later in zip(offsets, offsets[1:]))


# --- the request loop, against a fake client ------------------------------------------------------

def message(tokens: list[int], finish_reason: int = 0):
    return SimpleNamespace(token_ids=tokens, finish_reason=finish_reason)


class FakeRpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset"


class FakeClient:
    def __init__(self, script):
        self.script = script

    def stream(self, request, timeout=None):
        yield from self.script(request)


def fake_clock(monkeypatch, times):
    ticks = iter(times)
    monkeypatch.setattr(serve.time, "perf_counter", lambda: next(ticks))


def test_run_request_records_times_of_token_carrying_messages(monkeypatch):
    def script(_):
        yield message([11])
        yield message([])  # no tokens (a text-only delta): not a token message
        yield message([12, 13], finish_reason=2)

    fake_clock(monkeypatch, [1.0, 1.5, 1.6, 1.8])
    record = RequestRecord(prompt_len=3)
    serve.run_request(FakeClient(script), None, record, None, None)
    assert record.error is None
    assert record.send_time == 1.0
    assert record.message_times == [1.5, 1.8]
    assert record.message_tokens == [1, 2]
    assert record.finish_time == 1.8 and record.finish_reason == 2


def test_run_request_counts_an_rpc_error(monkeypatch):
    def script(_):
        yield message([11])
        raise FakeRpcError()

    fake_clock(monkeypatch, [1.0, 1.5, 2.0])
    record = RequestRecord(prompt_len=3)
    semaphore = threading.Semaphore(1)
    serve.run_request(FakeClient(script), None, record, semaphore, None)
    assert record.error == "UNAVAILABLE: connection reset"
    assert record.finish_time == 2.0
    assert semaphore.acquire(blocking=False)  # released despite the failure


def test_run_request_stream_without_finish_reason_fails(monkeypatch):
    def script(_):
        yield message([11])

    fake_clock(monkeypatch, [1.0, 1.5, 1.7])
    record = RequestRecord(prompt_len=3)
    serve.run_request(FakeClient(script), None, record, None, None)
    assert record.error == "stream ended without a finish reason"
    assert record.finish_time == 1.7


def test_run_benchmark_respects_max_concurrency():
    lock = threading.Lock()
    in_flight = peak = 0

    def script(request):
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.02)
        with lock:
            in_flight -= 1
        yield message([1, 2, 3], finish_reason=2)

    args = argparse.Namespace(output_len=3, request_rate=math.inf, seed=0, max_concurrency=2, request_timeout=None)
    records = serve.run_benchmark(FakeClient(script), [[1, 2]] * 6, args, cache_salt="")
    assert peak == 2
    assert all(r.error is None and r.output_tokens == 3 for r in records)
    assert summarize(records, 3)["completed"] == 6


def test_format_report_renders_missing_values_as_dashes():
    metrics = summarize([RequestRecord(prompt_len=10, send_time=0.0, finish_time=0.5, error="boom")], 4)
    metrics["workload"] = {"num_requests": 1, "prompt_len": [64, 512], "output_len": 4, "request_rate": "inf",
                           "max_concurrency": None}
    metrics["server"] = {"started_by_benchmark": False, "address": "localhost:1", "served_model": "m"}
    report = serve.format_report(metrics, "t")
    assert "0 completed, 1 failed" in report
    assert "error x1: boom" in report
    assert [line.split() for line in report.splitlines() if line.startswith("TTFT")] == [["TTFT"] + ["-"] * 4]
