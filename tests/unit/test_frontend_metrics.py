"""The frontend's Prometheus metrics: latencies on a clock the test moves, token and request counts through
the gRPC Generate of a frontend on a fake scheduler (tests/unit/test_frontend_aio.py's), and the back end's
state read at scrape time."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.metrics import FOLD_AT, BackendStats, FrontendMetrics, token_buckets
from frontend.server import GenerationServicer, SchedulerLink
from pagedserve.client import build_request
from pagedserve.service import AioService
from pagedserve.v1 import generate_pb2_grpc, scheduler_pb2
from tests.unit.test_frontend_aio import FakeScheduler, released

MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def value(metrics: FrontendMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value("pagedserve:" + name, {"model_name": MODEL, **labels})


def test_latencies_are_measured_from_arrival_on_the_frontends_clock():
    clock = Clock()
    metrics = FrontendMetrics(MODEL, 4096, clock=clock)
    times = metrics.arrived()
    metrics.prompt(7)
    clock.now += 0.25
    metrics.scheduled(times, 0.125, 0.1)  # the scheduler's times come with the first token
    metrics.output(times, 1)  # first token: TTFT 0.25
    metrics.scheduled(times, 9.0, 9.0)  # (a restarted scheduler's, after the first token: not this request's)
    clock.now += 0.05
    metrics.output(times, 0)  # an output without tokens (a stop string cut it) is no token
    metrics.output(times, 2)  # an output of two tokens (a client that reads slowly): one gap of 0.05
    clock.now += 0.1
    metrics.output(times, 1)
    metrics.ended_request(times, "length")

    assert value(metrics, "time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value(metrics, "time_to_first_token_seconds_count") == 1
    assert value(metrics, "inter_token_latency_seconds_count") == 2
    assert value(metrics, "inter_token_latency_seconds_sum") == pytest.approx(0.15)
    assert value(metrics, "e2e_request_latency_seconds_sum") == pytest.approx(0.4)
    # (e2e - TTFT) / (tokens - 1) = 0.15 / 3
    assert value(metrics, "request_time_per_output_token_seconds_sum") == pytest.approx(0.05)
    assert value(metrics, "generation_tokens_total") == 4
    assert value(metrics, "request_generation_tokens_sum") == 4
    assert value(metrics, "prompt_tokens_total") == 7
    assert value(metrics, "request_prompt_tokens_sum") == 7
    assert value(metrics, "request_success_total", finished_reason="length") == 1
    assert value(metrics, "request_queue_time_seconds_sum") == 0.125
    assert value(metrics, "request_prefill_time_seconds_sum") == 0.1
    assert value(metrics, "request_decode_time_seconds_sum") == pytest.approx(0.15)
    assert value(metrics, "request_inference_time_seconds_sum") == pytest.approx(0.25)


def test_an_aborted_or_failed_request_is_counted_but_its_times_are_not():
    clock = Clock()
    metrics = FrontendMetrics(MODEL, 4096, clock=clock)
    aborted, failed = metrics.arrived(), metrics.arrived()
    clock.now += 1.0
    metrics.output(aborted, 3)
    metrics.ended_request(aborted, "abort")
    metrics.ended_request(failed, "overloaded")
    assert value(metrics, "request_success_total", finished_reason="abort") == 1
    assert value(metrics, "request_success_total", finished_reason="overloaded") == 1
    assert value(metrics, "generation_tokens_total") == 3  # sent before the client went away
    assert value(metrics, "e2e_request_latency_seconds_count") == 0
    assert value(metrics, "request_time_per_output_token_seconds_count") == 0


def test_buckets_hold_values_up_to_their_bound_and_count_alike_before_and_after_a_fold():
    metrics = FrontendMetrics(MODEL, 4096)
    values = [3, 5, 5, 6, 2000, 5000] * (FOLD_AT // 3)  # folds part-way (FOLD_AT pending), the rest at the scrape
    for v in values:
        metrics.prompt(v)
    n = len(values) // 6

    def bucket(le: str) -> float:
        return value(metrics, "request_prompt_tokens_bucket", le=le)

    assert bucket("2.0") == 0 and bucket("5.0") == 3 * n and bucket("10.0") == 4 * n
    assert bucket("2000.0") == 5 * n and bucket("+Inf") == 6 * n  # 5000 is past the last bound (4096 tokens)
    assert value(metrics, "request_prompt_tokens_sum") == sum(values) == value(metrics, "prompt_tokens_total")


def test_token_buckets_run_1_2_5_up_to_the_context_length():
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_buckets(1) == (1,)


def test_the_back_ends_state_is_read_at_each_scrape_and_left_out_when_unknown():
    answers = [
        BackendStats(num_running=3, num_waiting=2, num_preemptions=5, kv_cache_usage=0.25,
                     prefix_cache_queries=1000, prefix_cache_hits=640),
        BackendStats(num_running=1, num_waiting=0, num_preemptions=5),  # the KV-cache service did not answer
        None,  # the scheduler did not answer
    ]
    metrics = FrontendMetrics(MODEL, 4096, backend_stats=lambda: answers.pop(0))

    def scrape() -> dict[str, float]:
        return {sample.name: sample.value for family in text_string_to_metric_families(metrics.exposition().decode())
                for sample in family.samples if sample.labels.get("model_name") == MODEL}

    first = scrape()
    assert first["pagedserve:num_requests_running"] == 3 and first["pagedserve:num_requests_waiting"] == 2
    assert first["pagedserve:kv_cache_usage_perc"] == 0.25
    assert first["pagedserve:prefix_cache_queries_total"] == 1000
    assert first["pagedserve:prefix_cache_hits_total"] == 640
    assert first["pagedserve:num_preemptions_total"] == 5
    second = scrape()
    assert second["pagedserve:num_requests_running"] == 1
    assert "pagedserve:kv_cache_usage_perc" not in second and "pagedserve:prefix_cache_hits_total" not in second
    third = scrape()
    assert "pagedserve:num_requests_running" not in third
    assert third["pagedserve:generation_tokens_total"] == 0  # the frontend's own metrics are always there


@pytest.fixture
def measured_frontend():
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("default"))
    scheduler = FakeScheduler()
    link = SchedulerLink(scheduler)
    info = scheduler_pb2.SchedulerInfo(model="fake", max_model_len=4096, vocab_size=tokenizer.vocab_size)
    metrics = FrontendMetrics(MODEL, info.max_model_len)
    service = AioService("frontend", "127.0.0.1", 0, public=True)
    generate_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(link, tokenizer, info, max_prompt_chars=10_000, max_streams=64, metrics=metrics),
        service.server)
    service.start()
    yield service, link, metrics
    link.close()
    service.stop(grace=0)


def test_every_request_through_generate_is_counted_with_its_tokens(measured_frontend):
    service, link, metrics = measured_frontend
    lengths = [3 + i for i in range(8)]

    async def one(stub, i: int) -> int:
        request = build_request(prompt_token_ids=[100 + 50 * i, 5, 6], max_tokens=lengths[i], ignore_eos=True)
        return sum([len(response.token_ids) async for response in stub.Generate(request, timeout=60)])

    async def cancelled(stub) -> None:
        call = stub.Generate(build_request(prompt_token_ids=[42], max_tokens=4000, ignore_eos=True))
        async for _ in call:
            break
        call.cancel()

    async def all_of_them():
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            n3 = build_request(prompt_token_ids=[900], max_tokens=4, ignore_eos=True, n=3)
            three = sum([len(r.token_ids) async for r in stub.Generate(n3, timeout=60)])
            sent = await asyncio.gather(*(one(stub, i) for i in range(8)))
            await cancelled(stub)
            return sent, three

    sent, three = asyncio.run(all_of_them())
    assert sent == lengths and three == 12
    assert released(link)
    assert value(metrics, "request_success_total", finished_reason="length") == 8 + 3
    assert value(metrics, "request_success_total", finished_reason="abort") == 1
    assert value(metrics, "time_to_first_token_seconds_count") == 8 + 3 + 1
    assert value(metrics, "e2e_request_latency_seconds_count") == 8 + 3
    assert value(metrics, "request_generation_tokens_sum") == sum(lengths) + 12
    sent_before_cancel = value(metrics, "generation_tokens_total") - sum(lengths) - 12
    assert sent_before_cancel >= 1
    assert value(metrics, "prompt_tokens_total") == 8 * 3 + 1 + 1  # the n=3 call's prompt counts once
