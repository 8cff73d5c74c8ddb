"""The executor's side of steps planned ahead: it feeds the token it sampled into a row that asks for it
(exactly what the scheduler would have sent, had it known it), refuses such a row when it sampled nothing
there, and serves a scheduler's steps on one stream, run in order and answered in order, with failures
told in the answer; the scheduler's end of the stream turns a broken stream into ExecutorUnavailable."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from executor_svc.build import build_model_runner
from executor_svc.model_runner import ModelRunner
from executor_svc.server import ExecutorServicer, StepWorker
from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedserve.convert import execute_step_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.service import Service, channel
from pagedserve.step import ExecuteRequest, ExecuteStep
from pagedserve.v1 import executor_pb2_grpc
from scheduler_svc import server as scheduler_server
from scheduler_svc.scheduler import ExecutorUnavailable, StepFailed
from scheduler_svc.server import RemoteBackends

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def prefill(request_id: str, tokens: list[int], block: int) -> ExecuteRequest:
    return ExecuteRequest(request_id, tokens, 0, [block], True, PARAMS, prompt_len=len(tokens))


@pytest.fixture(scope="module")
def runner_pair(tiny_llama_dir):
    """Two runners of the same weights: one told its tokens, one that feeds its own."""
    config = ModelConfig(str(tiny_llama_dir), device="cpu", dtype="float32")
    return [ModelRunner(config, CacheConfig(kv_cache_memory=1 << 20, block_size=16)) for _ in range(2)]


def test_a_fed_row_computes_exactly_what_a_row_told_the_token_computes(runner_pair):
    told, fed = runner_pair
    first = [r.execute(ExecuteStep([prefill("a", [3, 1, 4, 1, 5], 0), prefill("b", [9, 2, 6], 1)])) for r in (told, fed)]
    assert first[0].sampled == first[1].sampled
    positions = {"a": 5, "b": 3}
    for _ in range(6):
        told_step = ExecuteStep([ExecuteRequest(r, [first[0].sampled[r].token_id], positions[r], [], True) for r in "ab"])
        fed_step = ExecuteStep([ExecuteRequest(r, [], positions[r], [], True, feed_sampled=True) for r in "ab"])
        logits = told.step_logits(told_step), fed.step_logits(fed_step)
        for r in "ab":
            torch.testing.assert_close(logits[1][r], logits[0][r], rtol=0, atol=0)
        # step_logits samples nothing: run the same steps to sample and go on.
        first = [told.execute(told_step), fed.execute(fed_step)]
        assert first[0].sampled == first[1].sampled and not first[1].rejected
        positions = {r: p + 1 for r, p in positions.items()}


def test_a_fed_row_is_refused_where_nothing_was_sampled(runner_pair):
    _, runner = runner_pair
    runner.execute(ExecuteStep([prefill("c", [7, 7, 7], 2)]))
    result = runner.execute(ExecuteStep([
        ExecuteRequest("c", [], 4, [], True, feed_sampled=True),  # its sample takes position 3, not 4
        ExecuteRequest("ghost", [], 0, [], True, feed_sampled=True),
    ]))
    assert set(result.rejected) == {"c", "ghost"} and "position 4" in result.rejected["c"]
    assert not result.sampled
    # The request is unharmed: fed where its token was sampled, it goes on.
    assert "c" in runner.execute(ExecuteStep([ExecuteRequest("c", [], 3, [], True, feed_sampled=True)])).sampled


# ----------------------------------------------------------------------------- the stream


@pytest.fixture
def executor_service(tiny_llama_dir):
    runner = build_model_runner(ModelConfig(str(tiny_llama_dir), device="cpu", benchmark_sleep_ms=30.0),
                                CacheConfig(kv_cache_memory=1 << 20), SchedulerConfig())
    servicer = ExecutorServicer(runner)
    service = Service("executor_svc", "127.0.0.1", 0)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, service.server)
    service.start()
    stopping = threading.Event()
    worker = threading.Thread(target=servicer.worker.run, args=(stopping,), daemon=True)
    worker.start()
    ch = channel(service.address)
    yield runner, RemoteBackends(None, executor_pb2_grpc.ExecutorStub(ch)), service
    stopping.set()
    ch.close()
    service.stop(grace=0)


def test_steps_sent_ahead_run_in_order_and_failures_come_back_in_their_answers(executor_service):
    runner, backends, _ = executor_service
    epoch = runner.epoch
    # The second step feeds in what the first samples: it is sent before the first has come back.
    first = backends.submit(ExecuteStep([prefill("a", [1, 2, 3], 0)], executor_epoch=epoch, step_id=1))
    second = backends.submit(ExecuteStep([ExecuteRequest("a", [], 3, [], True, feed_sampled=True)],
                                         executor_epoch=epoch, step_id=2))
    stale = backends.submit(ExecuteStep([ExecuteRequest("a", [], 4, [], True, feed_sampled=True)],
                                        executor_epoch="another-instance", step_id=3))
    third = backends.submit(ExecuteStep([ExecuteRequest("a", [], 4, [], True, feed_sampled=True)],
                                        executor_epoch=epoch, step_id=4))
    assert "a" in first.result().sampled
    assert "a" in second.result().sampled and not second.result().rejected
    with pytest.raises(ExecutorUnavailable, match="FAILED_PRECONDITION"):
        stale.result()
    assert "a" in third.result().sampled  # the stream went on
    assert backends.executor_rpcs == 4


def test_the_next_step_is_launched_while_the_device_runs_the_one_before(tiny_llama_dir):
    """The benchmarking executor's stand-in device runs queued steps back to back: the host launches step 2
    (its own work for it) before step 1's result is handed over, and step 2's device time starts where step
    1's ends, not after the host has handed step 1 over."""
    runner = build_model_runner(ModelConfig(str(tiny_llama_dir), device="cpu", benchmark_sleep_ms=40.0),
                                CacheConfig(kv_cache_memory=1 << 20), SchedulerConfig())
    events, launched = [], []
    real = runner.launch

    def launch(step):
        events.append(f"launch {step.step_id}")
        launched.append(real(step))
        return launched[-1]

    runner.launch = launch
    worker, stopping = StepWorker(), threading.Event()
    steps = [ExecuteStep([prefill(f"r{i}", [1, 2], i)], executor_epoch=runner.epoch, step_id=i) for i in (1, 2, 3)]
    futures = []
    for step in steps:
        futures.append(worker.submit(runner.launch, step))
        futures[-1].add_done_callback(lambda _, i=step.step_id: events.append(f"answer {i}"))
    thread = threading.Thread(target=worker.run, args=(stopping,), daemon=True)
    started = time.monotonic()
    thread.start()
    assert [set(f.result(timeout=10).sampled) for f in futures] == [{"r1"}, {"r2"}, {"r3"}]
    elapsed = time.monotonic() - started
    stopping.set()
    thread.join()
    assert events == ["launch 1", "launch 2", "answer 1", "launch 3", "answer 2", "answer 3"]
    assert [b.ready_at - a.ready_at for a, b in zip(launched, launched[1:])] == pytest.approx([0.04, 0.04], abs=1e-9)
    assert 0.12 <= elapsed < 0.12 + 0.1


def test_a_malformed_step_is_refused_in_its_answer_naming_the_field(tiny_llama_dir):
    runner = build_model_runner(ModelConfig(str(tiny_llama_dir), device="cpu", benchmark_sleep_ms=1.0),
                                CacheConfig(kv_cache_memory=1 << 20), SchedulerConfig())
    message = execute_step_to_proto(ExecuteStep([ExecuteRequest("a", [], 5, [], True, feed_sampled=True)], step_id=7))
    message.decodes.positions.append(9)
    [answer] = ExecutorServicer(runner).Execute(iter([message]), context=None)
    assert (answer.step_id, answer.error.code) == (7, "INVALID_ARGUMENT") and "positions" in answer.error.message


def test_a_step_the_executor_raises_on_fails_alone(executor_service, monkeypatch):
    runner, backends, _ = executor_service
    real = runner.launch

    def launch(step):
        if step.step_id == 2:
            raise RuntimeError("boom")
        return real(step)

    monkeypatch.setattr(runner, "launch", launch)
    steps = [backends.submit(ExecuteStep([prefill(f"r{i}", [1, 2], i)], executor_epoch=runner.epoch, step_id=i))
             for i in (1, 2, 3)]
    assert "r1" in steps[0].result().sampled
    with pytest.raises(StepFailed, match="INTERNAL: RuntimeError: boom"):
        steps[1].result()
    assert "r3" in steps[2].result().sampled


def test_a_broken_stream_leaves_every_unanswered_step_in_doubt_and_the_next_step_opens_a_new_one(executor_service,
                                                                                                monkeypatch):
    runner, backends, service = executor_service
    # A server stopped in this process has, rarely, left the client's stream waiting without an error; the
    # stream's watchdog then ends the wait, here within seconds rather than the service's ten minutes.
    monkeypatch.setattr(scheduler_server, "RPC_TIMEOUT_S", 10.0)
    out = [backends.submit(ExecuteStep([prefill(f"r{i}", [1, 2], i)], executor_epoch=runner.epoch, step_id=i))
           for i in (1, 2)]
    broken = backends.streams[""]
    service.stop(grace=0)  # the executor goes away with both steps out
    for pending in out:
        with pytest.raises(ExecutorUnavailable):
            pending.result()
    assert broken.broken
    after = backends.submit(ExecuteStep([prefill("r3", [1, 2], 3)], executor_epoch=runner.epoch, step_id=3))
    assert backends.streams[""] is not broken
    with pytest.raises(ExecutorUnavailable):  # nobody serves: the new stream fails as well, in doubt
        after.result()


class SilentExecutor(executor_pb2_grpc.ExecutorServicer):
    """Takes the steps of a stream and never answers one, nor ends the stream: a hung executor."""

    def __init__(self) -> None:
        self.received, self.release = [], threading.Event()

    def Execute(self, request_iterator, context):
        for message in request_iterator:
            self.received.append(message.step_id)
            if len(self.received) == 1:
                self.release.wait(60)
        return iter(())


@pytest.mark.parametrize("steps_out", [1, 2])
def test_a_step_left_unanswered_is_in_doubt_once_overdue_even_the_last_one_out(monkeypatch, steps_out):
    """The stream's watchdog cancels it when the oldest step out is overdue; the step being waited for counts,
    also when no other step is out (the engine loop one step at a time, or the last step of a run)."""
    monkeypatch.setattr(scheduler_server, "RPC_TIMEOUT_S", 1.0)
    silent = SilentExecutor()
    service = Service("executor_svc", "127.0.0.1", 0)
    executor_pb2_grpc.add_ExecutorServicer_to_server(silent, service.server)
    service.start()
    ch = channel(service.address)
    try:
        backends = RemoteBackends(None, executor_pb2_grpc.ExecutorStub(ch))
        out = [backends.submit(ExecuteStep([prefill(f"r{i}", [1, 2], i)], step_id=i)) for i in range(1, steps_out + 1)]
        started = time.monotonic()
        for pending in out:
            with pytest.raises(ExecutorUnavailable, match="CANCELLED"):
                pending.result()
        assert time.monotonic() - started < 1.0 + 3 * scheduler_server.WATCH_EVERY_S
        assert silent.received[:1] == [1]
    finally:
        silent.release.set()
        ch.close()
        service.stop(grace=0)

