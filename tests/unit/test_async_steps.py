"""Steps planned ahead (async_scheduling), in process: the real engine loop, scheduler and block manager,
and the fake executor of tests/unit/test_scheduler.py (which feeds in the token it sampled when a row asks,
as the real one does).

The pipeline really overlaps: the executor finds the next step waiting each time it ends one, and gets it
before the scheduler has applied the result of the one before. A request found finished a step late
(max_tokens, EOS, a stop token, an abort while its step is out) gets no token after its last, and every
block comes back. Outputs are those of the loop without planning ahead, two steps out or three; and the
loop goes three out only while its own work takes most of the executor's step.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import pytest

from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.config import SchedulerConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep, one_executor
from scheduler_svc.engine_loop import DEEPER_ABOVE, SHALLOWER_BELOW, CompletedCall, EngineLoop
from scheduler_svc.request import Request
from scheduler_svc.scheduler import ExecutorUnavailable, Scheduler, StepFailed
from tests.unit.test_scheduler import EOS, CheckingExecutor, random_prompts

BLOCK_SIZE = 4
NUM_BLOCKS = 256


class Engine:
    """steps_ahead: how many steps may be out (1: no planning ahead; None: two or three, as the loop measures);
    submit: how a step reaches the executor (by default, in this process: it runs when sent)."""

    def __init__(self, steps_ahead: int | None, submit=None, **config) -> None:
        async_scheduling = steps_ahead != 1
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.executor = CheckingExecutor(self.manager, BLOCK_SIZE)
        config.setdefault("max_model_len", 256)
        self.scheduler = Scheduler(SchedulerConfig(block_size=BLOCK_SIZE, async_scheduling=async_scheduling, **config),
                                   one_executor(self.manager.step))
        submit = submit or (lambda step: CompletedCall(self.executor, step))
        self.loop = EngineLoop(self.scheduler, submit, lambda outputs: None, lambda: "", async_scheduling,
                               steps_ahead=steps_ahead if async_scheduling else None)
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}

    def add(self, request_id: str, prompt: list[int], **params) -> None:
        params = {"temperature": 0, "max_tokens": 12, **params}
        self.scheduler.add_request(Request(request_id, prompt, SamplingParams(**params), (EOS,),
                                           self.scheduler.config.max_model_len))
        self.outputs[request_id] = []

    def step(self) -> None:
        for output in self.loop.step():
            assert output.request_id not in self.finish, f"{output.request_id} got an output after it finished"
            self.outputs[output.request_id].extend(output.new_token_ids)
            if output.finished:
                self.finish[output.request_id] = output.finish_reason

    def run(self) -> None:
        for _ in range(5000):
            if not self.loop.has_work():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def rows(self, request_id: str) -> int:
        """Rows the executor computed for the request."""
        return sum(1 for step in self.executor.steps for r in step.requests if r.request_id == request_id)

    def assert_every_block_back(self) -> None:
        assert self.manager.num_requests == 0 and self.manager.num_free_blocks == NUM_BLOCKS
        assert not self.executor.block_tables, "the executor kept state of ended requests"


STEPS_AHEAD = (1, 2, 3)


@pytest.fixture(params=STEPS_AHEAD, ids=["sync", "two-ahead", "three-ahead"])
def steps_ahead(request) -> int:
    return request.param


def run_all(load) -> dict[int, Engine]:
    """The same load without planning ahead, and two and three steps out, by steps ahead."""
    engines = {}
    for steps_ahead in STEPS_AHEAD:
        engine = Engine(steps_ahead)
        load(engine)
        engine.run()
        engine.assert_every_block_back()
        engines[steps_ahead] = engine
    for engine in engines.values():
        assert engine.outputs == engines[1].outputs and engine.finish == engines[1].finish
    return engines


def raising(error: Exception):
    def execute(step: ExecuteStep):
        raise error
    return execute


class ThreadedExecutor:
    """The fake executor on a thread of its own, a fixed time per step, steps run in the order sent. It
    records, for each step it ends, whether the next one was already waiting, and how many results the
    engine loop had applied when each step arrived."""

    def __init__(self, inner: CheckingExecutor, step_s: float) -> None:
        self.inner, self.step_s = inner, step_s
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.next_was_waiting: list[bool] = []
        self.applied_when_sent: list[int] = []
        self.loop: EngineLoop | None = None
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, step: ExecuteStep) -> Future:
        self.applied_when_sent.append(self.loop.num_steps)
        future: Future = Future()
        self.jobs.put((future, step))
        return future

    def _run(self) -> None:
        while True:
            future, step = self.jobs.get()
            time.sleep(self.step_s)
            try:
                result = self.inner(step)
            except AssertionError as error:  # a feeding mistake: handed to the loop, which raises it
                future.set_exception(error)
                continue
            self.next_was_waiting.append(not self.jobs.empty())
            future.set_result(result)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_executor_gets_the_next_step_before_the_last_result_is_applied(async_scheduling):
    # Planned ahead as the services are (two or three steps out, as measured): the loop's work is tiny
    # beside a 20 ms step, so it stays two out.
    engine = Engine(None if async_scheduling else 1)
    engine.executor.block_manager = None  # the block manager plans ahead of what the executor has run
    threaded = ThreadedExecutor(engine.executor, step_s=0.02)
    engine.loop.submit, threaded.loop = threaded.submit, engine.loop
    for i, prompt in enumerate(random_prompts(8, seed=3, low=3, high=8)):
        engine.add(f"r{i}", prompt, max_tokens=20, ignore_eos=True)
    engine.run()
    engine.assert_every_block_back()
    steps = len(threaded.applied_when_sent)
    assert steps > 20
    if async_scheduling:
        # Step k goes out while step k-1 runs: before the loop has applied k-1 (nor, from the second on, k-2).
        assert threaded.applied_when_sent[:3] == [0, 0, 1]
        assert all(applied == k - 1 for k, applied in enumerate(threaded.applied_when_sent[1:-1], start=1))
        # So the executor never waits on the scheduler: a step is waiting each time it ends one (but the last
        # two: the steps that free the finished requests' blocks come after the last results).
        assert all(threaded.next_was_waiting[:-2])
    else:
        assert threaded.applied_when_sent == list(range(steps))
        assert not any(threaded.next_was_waiting)


def test_the_loop_goes_three_steps_out_only_while_its_own_work_takes_most_of_a_step():
    engine = Engine(None)
    engine.executor.block_manager = None  # the block manager plans ahead of what the executor has run
    threaded = ThreadedExecutor(engine.executor, step_s=0.002)
    engine.loop.submit, threaded.loop = threaded.submit, engine.loop
    for i, prompt in enumerate(random_prompts(4, seed=3, low=3, high=8)):
        engine.add(f"r{i}", prompt, max_tokens=80, ignore_eos=True)
    # A loop slower than its executor (5 ms of its own work per 2 ms step) goes three out...
    for _ in range(30):
        engine.step()
        time.sleep(0.005)
    assert engine.loop.deep and engine.loop.work_share > DEEPER_ABOVE and engine.loop.steps_out_limit() == 3
    sent = len(threaded.applied_when_sent)
    assert any(applied == k - 2 for k, applied in enumerate(threaded.applied_when_sent) if k >= 2)
    # ...and back to two once the executor's step (now 20 ms) dwarfs the loop's work.
    threaded.step_s = 0.02
    for _ in range(30):
        engine.step()
    assert not engine.loop.deep and engine.loop.work_share < SHALLOWER_BELOW and engine.loop.steps_out_limit() == 2
    last = len(threaded.applied_when_sent)
    assert last > sent + 5
    assert all(threaded.applied_when_sent[k] == k - 1 for k in range(last - 5, last))
    engine.run()
    engine.assert_every_block_back()
    reference = Engine(1)
    for i, prompt in enumerate(random_prompts(4, seed=3, low=3, high=8)):
        reference.add(f"r{i}", prompt, max_tokens=80, ignore_eos=True)
    reference.run()
    assert engine.outputs == reference.outputs


def test_max_tokens_is_not_planned_past():
    engines = run_all(lambda engine: engine.add("r", [1, 2, 3], max_tokens=5, ignore_eos=True))
    for engine in engines.values():
        assert engine.finish["r"] == "length" and len(engine.outputs["r"]) == 5
        # The prompt, then four decodes: the token that reaches max_tokens is never computed on.
        assert engine.rows("r") == 5


def test_a_request_found_at_eos_a_step_late_emits_nothing_more():
    prompt = [1, 2, 3]

    def load(engine: Engine) -> None:
        engine.executor.eos_after = {"eos": 8}  # the 6th output makes the sequence 8 long: the 6th is EOS
        engine.add("eos", prompt, max_tokens=50)
        engine.add("other", [4, 5, 6, 7], max_tokens=12, ignore_eos=True)

    engines = run_all(load)
    for engine in engines.values():
        assert engine.finish["eos"] == "stop" and engine.outputs["eos"][-1] == EOS and len(engine.outputs["eos"]) == 6
    # Planned ahead, the steps after the EOS token ran for it before the EOS was known: their tokens were dropped.
    for steps_ahead in (2, 3):
        assert engines[steps_ahead].rows("eos") == engines[1].rows("eos") + steps_ahead - 1


def test_a_stop_token_found_a_step_late_emits_nothing_more():
    def load(engine: Engine) -> None:
        first = engine.executor.next_token("", [1, 2, 3])
        engine.add("stop", [1, 2, 3], max_tokens=50, stop_token_ids=[first])

    engines = run_all(load)
    for engine in engines.values():
        assert engine.finish["stop"] == "stop" and len(engine.outputs["stop"]) == 1


def test_an_abort_while_the_step_is_out_emits_nothing_more_and_frees_the_blocks(steps_ahead):
    engine = Engine(steps_ahead)
    engine.add("keep", list(range(10)), max_tokens=30, ignore_eos=True)
    engine.add("drop", list(range(100, 120)), max_tokens=30, ignore_eos=True)
    for _ in range(4):
        engine.step()
    out = [s for s in engine.loop.in_flight if any(r.request_id == "drop" for r in s.step.requests)]
    assert bool(out) == (steps_ahead > 1), "planned ahead, a step holding the request is out"
    received = len(engine.outputs["drop"])
    assert engine.scheduler.abort_request("drop").finish_reason == "abort"
    engine.finish["drop"] = "abort"
    engine.run()  # step() fails the test if "drop" gets anything more
    assert len(engine.outputs["drop"]) == received
    assert engine.finish["keep"] == "length" and len(engine.outputs["keep"]) == 30
    engine.assert_every_block_back()


def test_a_step_that_raises_rolls_back_the_steps_sent_after_it(steps_ahead):
    engine = Engine(steps_ahead)
    failing = {"count": 0}

    def submit(step: ExecuteStep):
        # The fourth step raises, once.
        failing["count"] += 1
        if failing["count"] == 4:
            return CompletedCall(raising(StepFailed("INTERNAL: boom")), step)
        return CompletedCall(engine.executor, step)

    engine.loop.submit = submit
    for i, prompt in enumerate(random_prompts(3, seed=5)):
        engine.add(f"r{i}", prompt, max_tokens=10, ignore_eos=True)
    reference = run_all(lambda e: [e.add(f"r{i}", p, max_tokens=10, ignore_eos=True)
                                    for i, p in enumerate(random_prompts(3, seed=5))])[1]
    engine.run()
    # Planned ahead, the steps after the one that raised were out too: all of them were rolled back.
    assert engine.loop.num_failed_steps == steps_ahead
    assert engine.outputs == reference.outputs and engine.finish == reference.finish
    engine.assert_every_block_back()


@pytest.mark.parametrize("steps_ahead", [2, 3])
def test_an_executor_lost_with_steps_out_rolls_them_all_back_and_recomputes(steps_ahead):
    engine = Engine(steps_ahead)
    sent = {"count": 0}

    def submit(step: ExecuteStep):
        sent["count"] += 1
        if 5 <= sent["count"] < 5 + steps_ahead:  # every step out when the executor goes away
            return CompletedCall(raising(ExecutorUnavailable("UNAVAILABLE")), step)
        return CompletedCall(engine.executor, step)

    engine.loop.submit = submit
    prompts = random_prompts(4, seed=6)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, max_tokens=10, ignore_eos=True)
    reference = run_all(lambda e: [e.add(f"r{i}", p, max_tokens=10, ignore_eos=True) for i, p in enumerate(prompts)])
    engine.run()
    assert engine.loop.num_failed_steps == steps_ahead and engine.scheduler.num_recomputed_tokens > 0
    assert engine.outputs == reference[1].outputs
    engine.assert_every_block_back()


def test_a_request_preempted_while_its_step_is_out_keeps_that_steps_token():
    """A pool too small for all: the block manager preempts requests whose step is still out. The token
    that step samples is theirs (it was computed from their true context), and their outputs are those
    of a run without planning ahead."""
    prompts = random_prompts(12, seed=7, low=20, high=40)

    def load(engine: Engine) -> None:
        for i, prompt in enumerate(prompts):
            engine.add(f"r{i}", prompt, max_tokens=16, ignore_eos=True)

    small = NUM_BLOCKS // 8  # each request needs up to 14 blocks: far fewer than 12 of them at once
    engines = {}
    for steps_ahead in STEPS_AHEAD:
        engine = Engine(steps_ahead, max_num_batched_tokens=64)
        engine.manager = KVCacheManager(small, BLOCK_SIZE)
        engine.executor.block_manager = engine.manager
        engine.scheduler.allocate_blocks = one_executor(engine.manager.step)
        load(engine)
        engine.run()
        assert engine.manager.num_requests == 0 and engine.manager.num_free_blocks == small
        engines[steps_ahead] = engine
    for steps_ahead in (2, 3):
        assert engines[steps_ahead].scheduler.num_preemptions > 0
        assert engines[steps_ahead].outputs == engines[1].outputs
    assert all(len(tokens) == 16 for tokens in engines[1].outputs.values())


def test_a_structured_request_is_not_planned_on_while_its_sample_may_be_deferred(steps_ahead):
    """The executor may defer a structured request's sample (its grammar still compiling): then its last token
    is computed again, so a step planned on the pending token would be wrong. None is; outputs are unchanged."""
    def load(engine: Engine) -> None:
        engine.add("s", [5, 6, 7, 8, 9], json_object=True, ignore_eos=True, max_tokens=6)
        engine.add("r", [1, 2, 3], ignore_eos=True, max_tokens=6)

    reference = Engine(steps_ahead)
    load(reference)
    reference.run()
    deferrals = {"s": 3}

    def deferring(step: ExecuteStep):
        result = engine.executor(step)
        for req in step.requests:
            if req.request_id in result.sampled and deferrals.get(req.request_id):
                deferrals[req.request_id] -= 1
                del result.sampled[req.request_id]
                result.deferred.append(req.request_id)
                engine.executor.progress[req.request_id] -= 1  # the executor keeps nothing of a deferred token
        return result

    engine = Engine(steps_ahead, submit=lambda step: CompletedCall(deferring, step))
    load(engine)
    engine.run()
    engine.assert_every_block_back()
    assert deferrals == {"s": 0} and engine.outputs == reference.outputs
    assert not any(r.feed_sampled for step in engine.executor.steps for r in step.requests if r.request_id == "s")
    if steps_ahead > 1:
        assert any(r.feed_sampled for step in engine.executor.steps for r in step.requests if r.request_id == "r")


def test_three_steps_out_plan_most_decode_steps_without_calling_the_block_manager():
    """Three out, the block manager reserves a block's worth of slots ahead per running request, and steps
    that need no more slots, admit nobody and free nothing are planned without it: the same outputs, every
    block back."""
    def load(engine: Engine) -> None:
        for i, prompt in enumerate(random_prompts(6, seed=3)):
            engine.add(f"r{i}", prompt, max_tokens=40, ignore_eos=True)

    engines = run_all(load)
    assert engines[1].scheduler.num_calls_skipped == engines[2].scheduler.num_calls_skipped == 0
    three = engines[3]
    assert three.scheduler.num_calls_skipped > three.loop.num_steps / 2, (three.scheduler.num_calls_skipped,
                                                                        three.loop.num_steps)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_offline_engine_loads_its_model_on_the_thread_that_runs_its_steps(tiny_llama_dir, monkeypatch,
                                                                               async_scheduling):
    """torch's OpenMP pool belongs to the thread that uses it: a model loaded on one thread and run on another
    leaves two pools, and libgomp, counting more threads than cores, puts the workers to sleep between operators."""
    import executor_svc.model_runner as model_runner
    from pagedserve import LLM

    loaded_on, stepped_on = [], set()
    init, execute = model_runner.ModelRunner.__init__, model_runner.ModelRunner.execute

    def recording_init(self, *args, **kwargs):
        loaded_on.append(threading.get_ident())
        init(self, *args, **kwargs)

    def recording_execute(self, step):
        stepped_on.add(threading.get_ident())
        return execute(self, step)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", recording_init)
    monkeypatch.setattr(model_runner.ModelRunner, "execute", recording_execute)
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=4 << 20, async_scheduling=async_scheduling)
    [result] = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(result.token_ids) == 4
    assert stepped_on == set(loaded_on) and len(loaded_on) == 1
    assert (loaded_on[0] == threading.get_ident()) == (not async_scheduling)
