"""Failures on the hot path, in process: the real scheduler, block manager and engine loop with a fake
executor that stores each token in its KV slot (tests/unit/test_scheduler.py), so that reading KV the
executor never computed changes the output. No failure may ever give a wrong answer: the prefix index
names only blocks whose step ran, a new executor instance starts from nothing, a refused or poisonous
request fails alone, and every other request ends with the output of a fault-free run."""
from __future__ import annotations

import dataclasses
import random

import pytest

from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.config import SchedulerConfig
from pagedserve.step import ExecuteResult, ExecuteStep, one_executor
from scheduler_svc.engine_loop import CompletedCall, EngineLoop
from scheduler_svc.scheduler import BlockManagerUnavailable, ExecutorUnavailable, Scheduler, StepFailed
from tests.unit.test_scheduler import EOS, CheckingExecutor, add

BLOCK_SIZE = 4
MAX_TOKENS = 10


class FaultyExecutor:
    """A CheckingExecutor behind a switchboard of faults; a restart is a new instance with empty KV."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.epoch = 0
        self.inner = CheckingExecutor(manager, BLOCK_SIZE)
        self.fail_next: list[Exception] = []  # raised by the next calls, in order, before anything runs
        self.poison: set[str] = set()  # a step holding one of these raises
        self.refuse: set[str] = set()  # refused, as the executor refuses a request it cannot run
        self.calls = 0

    def restart(self) -> None:
        self.epoch += 1
        self.inner = CheckingExecutor(self.manager, BLOCK_SIZE)

    def executor_epoch(self) -> str:
        return str(self.epoch)

    def __call__(self, step: ExecuteStep) -> ExecuteResult:
        self.calls += 1
        if step.executor_epoch != str(self.epoch):
            raise ExecutorUnavailable("a step for another instance")
        if self.fail_next or self.poison & {r.request_id for r in step.requests}:
            # As the executor does, a failed step leaves none of its requests' state behind: a step sent
            # after it (void, rolled back with it) finds them unknown rather than running on stale tables.
            for r in step.requests:
                self.inner.progress.pop(r.request_id, None)
            raise self.fail_next.pop(0) if self.fail_next else StepFailed("INTERNAL: poisoned")
        refused = {r.request_id: "refused" for r in step.requests if r.request_id in self.refuse}
        result = self.inner(dataclasses.replace(step, requests=[r for r in step.requests if r.request_id not in refused]))
        result.rejected = refused
        return result


class Engine:
    """async_scheduling: the loop plans a step while the one before it is out (steps_ahead of them: None, two
    or three as the loop measures); the fake executor, in this process, runs each step as it is sent, before
    the loop has applied the result of the one before."""

    def __init__(self, num_blocks: int = 64, budget: int = 16, async_scheduling: bool = True,
                 steps_ahead: int | None = None) -> None:
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE, model_id="test")
        self.kv_down = False
        self.executor = FaultyExecutor(self.manager)
        config = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget, max_model_len=256,
                                 async_scheduling=async_scheduling)
        self.scheduler = Scheduler(config, one_executor(self.allocate), executor_epoch=self.executor.executor_epoch())
        self.loop = EngineLoop(self.scheduler, lambda step: CompletedCall(self.executor, step), lambda outputs: None,
                               self.executor.executor_epoch, async_scheduling=async_scheduling,
                               steps_ahead=steps_ahead)
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, tuple[str, str | None]] = {}
        self.prompts: dict[str, list[int]] = {}

    def allocate(self, request):
        if self.kv_down:
            raise BlockManagerUnavailable("UNAVAILABLE")
        return self.manager.step(request)

    def add(self, request_id: str, prompt: list[int]) -> None:
        add(self.scheduler, request_id, prompt, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        self.prompts[request_id] = prompt
        self.outputs[request_id] = []

    def step(self) -> None:
        for output in self.loop.step():
            self.outputs[output.request_id].extend(output.new_token_ids)
            if output.finished:
                self.finish[output.request_id] = (output.finish_reason, output.error)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.loop.has_work():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def expected(self, request_id: str) -> list[int]:
        sequence = list(self.prompts[request_id])
        for _ in range(MAX_TOKENS):
            sequence.append(self.executor.inner.next_token("", sequence))
        return sequence[len(self.prompts[request_id]):]

    def assert_fault_free_outputs(self, *request_ids: str) -> None:
        for request_id in request_ids:
            assert self.finish[request_id] == ("length", None), request_id
            assert self.outputs[request_id] == self.expected(request_id), request_id

    def assert_index_truthful(self) -> None:
        """Every indexed block holds, in the executor's KV, exactly the tokens its hash names."""
        for state in self.manager.requests.values():
            for i, block_hash in enumerate(state.block_hashes):
                block = state.blocks[i]
                if block.block_hash == block_hash:
                    slots = [block.block_id * BLOCK_SIZE + j for j in range(BLOCK_SIZE)]
                    assert [self.executor.inner.slots.get(s) for s in slots] == \
                        state.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def async_scheduling(request) -> bool:
    return request.param


def prompt(seed: int, length: int = 22) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(EOS) for _ in range(length)]


def test_a_failed_step_indexes_nothing_and_the_same_prompt_is_right_afterwards(async_scheduling):
    engine = Engine(async_scheduling=async_scheduling)
    engine.add("a", prompt(1))
    # The first step would fill blocks of a's prompt; it raises, alone, so a fails with the error.
    engine.executor.fail_next = [StepFailed("INTERNAL: boom")]
    engine.step()
    assert engine.finish["a"][0] == "error" and "boom" in engine.finish["a"][1]
    engine.step()  # hands a's blocks back
    assert engine.manager.block_pool.cached_blocks == {}, "blocks of a failed step were indexed"
    engine.add("b", prompt(1))
    engine.run()
    engine.assert_fault_free_outputs("b")


def test_a_step_lost_on_the_way_is_rolled_back_and_rerun(async_scheduling):
    engine = Engine(async_scheduling=async_scheduling)
    for i in range(4):
        engine.add(f"r{i}", prompt(i))
    engine.step()
    engine.executor.fail_next = [ExecutorUnavailable("DEADLINE_EXCEEDED"), ExecutorUnavailable("UNAVAILABLE")]
    engine.step()
    engine.step()  # still no executor: nothing is planned, the loop backs off
    assert engine.loop.retry_delay > 0 and engine.loop.outage == "the executor"
    engine.run()
    assert engine.loop.outage is None and engine.loop.retry_delay == 0
    engine.assert_fault_free_outputs(*(f"r{i}" for i in range(4)))


def test_a_new_executor_instance_recomputes_everything_and_nothing_cached_survives(async_scheduling):
    engine = Engine(async_scheduling=async_scheduling)
    shared = prompt(7, 16)
    engine.add("warm", shared + [1, 2])
    engine.run()
    assert engine.manager.block_pool.cached_blocks, "the warm request left its prefix cached"
    for i in range(3):
        engine.add(f"r{i}", shared + prompt(10 + i, 6))
    for _ in range(3):
        engine.step()
    engine.executor.restart()  # its KV is empty; the index must not be believed
    engine.run()
    engine.assert_fault_free_outputs("warm", "r0", "r1", "r2")
    engine.add("again", shared + [1, 2])
    engine.run()
    engine.assert_fault_free_outputs("again")
    engine.assert_index_truthful()


def test_a_refused_request_fails_alone_and_its_blocks_are_not_indexed(async_scheduling):
    engine = Engine(async_scheduling=async_scheduling)
    for i in range(3):
        engine.add(f"r{i}", prompt(20 + i))
    engine.executor.refuse = {"r1"}
    engine.run()
    assert engine.finish["r1"] == ("error", "refused")
    engine.assert_fault_free_outputs("r0", "r2")
    engine.add("again", prompt(21))
    engine.executor.refuse = set()
    engine.run()
    engine.assert_fault_free_outputs("again")


def test_a_poisonous_request_among_many_fails_alone(async_scheduling):
    engine = Engine(budget=64, async_scheduling=async_scheduling)
    for i in range(5):
        engine.add(f"r{i}", prompt(30 + i))
    engine.executor.poison = {"r3"}
    engine.run()
    assert engine.finish["r3"][0] == "error" and "poisoned" in engine.finish["r3"][1]
    engine.assert_fault_free_outputs("r0", "r1", "r2", "r4")
    assert not engine.scheduler.suspects


def test_a_block_manager_that_restarts_empty_has_every_request_recomputed(async_scheduling):
    engine = Engine(async_scheduling=async_scheduling)
    for i in range(3):
        engine.add(f"r{i}", prompt(40 + i))
    for _ in range(4):
        engine.step()
    engine.kv_down = True
    calls = engine.executor.calls
    for _ in range(5):
        engine.step()
    assert engine.executor.calls == calls, "a step ran without the block manager"
    assert engine.loop.retry_delay > 0
    # It comes back with none of its state (no Redis): the running requests are unknown to it.
    fresh = KVCacheManager(64, BLOCK_SIZE, model_id="test")
    engine.manager = engine.executor.manager = engine.executor.inner.block_manager = fresh
    engine.kv_down = False
    engine.run()
    engine.assert_fault_free_outputs("r0", "r1", "r2")


def test_a_block_manager_answer_lost_on_the_way_indexes_nothing_it_planned(async_scheduling):
    engine = Engine(async_scheduling=async_scheduling)
    engine.add("a", prompt(50))
    engine.step()
    real = engine.manager.step

    def served_but_lost(request):
        real(request)
        raise BlockManagerUnavailable("DEADLINE_EXCEEDED")

    engine.scheduler.allocate_blocks = one_executor(served_but_lost)
    engine.step()
    engine.scheduler.allocate_blocks = one_executor(engine.allocate)
    engine.run()
    engine.assert_fault_free_outputs("a")
    engine.add("b", prompt(50))
    engine.run()
    engine.assert_fault_free_outputs("b")
