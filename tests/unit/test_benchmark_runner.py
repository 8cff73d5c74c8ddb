"""The benchmarking executor (--benchmark-sleep-ms): no model, a sleep per step, deterministic tokens, and
the real Execute contract (per-request state, rejections, epochs)."""
from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path

import pytest

from executor_svc.benchmark_runner import PR_SET_TIMERSLACK, SleepingRunner, sleep_exactly
from executor_svc.build import build_model_runner
from executor_svc.model_runner import StaleEpoch
from executor_svc.server import executor_info
from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteRequest, ExecuteStep


@pytest.fixture
def runner(tiny_llama_dir):
    built = build_model_runner(ModelConfig(str(tiny_llama_dir), device="cpu", benchmark_sleep_ms=20.0),
                               CacheConfig(kv_cache_memory=1 << 20), SchedulerConfig())
    assert isinstance(built, SleepingRunner)
    return built


def prefill(request_id: str, tokens: list[int], blocks: list[int]) -> ExecuteRequest:
    return ExecuteRequest(request_id=request_id, token_ids=tokens, start_position=0, new_block_ids=blocks,
                          sample=True, sampling_params=SamplingParams(temperature=0, max_tokens=4), prompt_len=len(tokens))


def test_sleeps_per_step_and_returns_the_same_tokens_for_the_same_steps(runner):
    step = ExecuteStep([prefill("a", [1, 2, 3], [0]), prefill("b", [4, 5], [1])], executor_epoch=runner.epoch)
    started = time.perf_counter()
    first = runner.execute(step)
    assert time.perf_counter() - started >= 0.02
    assert set(first.sampled) == {"a", "b"} and first.num_prefill_tokens == 5
    assert all(t.token_id not in runner.eos_token_ids and 0 <= t.token_id < runner.config.vocab_size
               for t in first.sampled.values())
    decode = ExecuteStep([ExecuteRequest(request_id="a", token_ids=[first.sampled["a"].token_id], start_position=3,
                                         new_block_ids=[], sample=True)],
                         executor_epoch=runner.epoch)
    second = runner.execute(decode)
    assert second.num_decode_tokens == 1 and second.sampled["a"].token_id != first.sampled["a"].token_id
    again = build_model_runner(runner.model_config, runner.cache_config, SchedulerConfig())
    assert again.execute(ExecuteStep(step.requests)).sampled == first.sampled


def test_speaks_the_execute_contract(runner):
    bad = ExecuteRequest(request_id="x", token_ids=[runner.config.vocab_size], start_position=0,
                         new_block_ids=[0], sample=True, sampling_params=SamplingParams(), prompt_len=1)
    unknown = ExecuteRequest(request_id="ghost", token_ids=[1], start_position=5, new_block_ids=[], sample=True)
    result = runner.execute(ExecuteStep([bad, unknown, prefill("ok", [1, 2], [2])], executor_epoch=runner.epoch))
    assert set(result.rejected) == {"x", "ghost"} and set(result.sampled) == {"ok"}
    with pytest.raises(StaleEpoch):
        runner.execute(ExecuteStep([prefill("late", [1], [3])], executor_epoch="another-instance"))
    info = executor_info(runner)
    assert info.attention_backend == "none" and info.epoch == runner.epoch and info.num_blocks == runner.num_blocks


@pytest.mark.skipif(not Path("/proc/self/timerslack_ns").exists(), reason="per-thread timer slack is Linux's")
def test_its_sleep_runs_on_the_least_timer_slack_of_the_thread_that_sleeps():
    """Linux lets a sleep run up to 50 us late by default, which the busy fraction would count against the
    control plane; only the thread that sleeps changes."""
    slack = {}

    def step() -> None:
        path = Path(f"/proc/{threading.get_native_id()}/timerslack_ns")
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 40_000, 0, 0, 0)  # a new thread's is its creator's
        slack["before"] = int(path.read_text())
        sleep_exactly(0.001)
        slack["after"] = int(path.read_text())

    main_thread_slack = Path("/proc/self/timerslack_ns").read_text()
    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert slack == {"before": 40_000, "after": 1}
    assert Path("/proc/self/timerslack_ns").read_text() == main_thread_slack


def test_decodes_of_its_own_samples_are_checked_as_any_row(runner):
    """The steady decode row (the runner feeds its own last sample in) takes a short path; what it may not do
    is refused all the same: a position it did not sample, a position its blocks cannot hold, a block id
    outside the pool."""
    block_size = runner.block_size
    runner.execute(ExecuteStep([prefill("a", [1] * block_size, [0])], executor_epoch=runner.epoch))

    def decode(position: int, new_blocks: list[int]):
        row = ExecuteRequest("a", [], position, new_blocks, True, feed_sampled=True)
        return runner.execute(ExecuteStep([row], executor_epoch=runner.epoch))

    assert "no token was sampled" in decode(block_size + 1, [1]).rejected["a"]
    assert "cannot hold" in decode(block_size, []).rejected["a"]
    assert "block ids" in decode(block_size, [runner.num_blocks]).rejected["a"]
    assert "a" in decode(block_size, [1]).sampled  # the second block holds it
    assert "a" in decode(block_size + 1, []).sampled  # and the next, on the same blocks


def test_a_decode_past_the_longest_context_is_refused(runner):
    end = runner.max_model_len
    runner.execute(ExecuteStep([prefill("long", [1] * end, list(range(-(-end // runner.block_size))))],
                               executor_epoch=runner.epoch))
    row = ExecuteRequest("long", [], end, [], True, feed_sampled=True)
    assert "outside" in runner.execute(ExecuteStep([row], executor_epoch=runner.epoch)).rejected["long"]
