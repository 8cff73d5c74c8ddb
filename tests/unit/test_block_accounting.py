"""The scheduler and the block manager together, under shared prefixes, salts, cancels and a pool a quarter
of what the load needs: the block manager is the only one that counts blocks, preemption takes the newest
running request (under the priority policy: the lowest priority, then the newest), outputs are those of an
unconstrained run, and every block is accounted for at every step; with steps planned ahead too."""
from __future__ import annotations

import random

import pytest

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.step import BlockStepRequest, BlockStepResult, one_executor
from pagedserve.sampling_params import SamplingParams
from scheduler_svc.engine_loop import CompletedCall, EngineLoop
from scheduler_svc.request import Request
from tests.unit.test_scheduler import EOS, CheckingExecutor
from scheduler_svc.scheduler import Scheduler, SchedulerConfig

BLOCK_SIZE = 4
MAX_TOKENS = 12
PREFIXES = [random.Random(i).choices(range(EOS), k=4 * BLOCK_SIZE) for i in range(3)]
MAX_PROMPT = len(PREFIXES[0]) + 8
MAX_CONCURRENT = 12
# A quarter of what MAX_CONCURRENT requests of the longest kind hold at their end.
NUM_BLOCKS = MAX_CONCURRENT * -(-(MAX_PROMPT + MAX_TOKENS) // BLOCK_SIZE) // 4


class ObservedBlockManager:
    """The real block manager, with each step's decisions checked against what the pool held."""

    def __init__(self, manager: KVCacheManager, priority_of=None) -> None:
        self.manager = manager
        self.admitted_order: dict[str, int] = {}  # request id -> when it was (last) admitted
        self.num_admissions = 0
        self.num_preemptions = 0
        # Under the priority policy: request id -> (priority, arrival), the order running requests must keep.
        self.priority_of = priority_of

    def step(self, request: BlockStepRequest) -> BlockStepResult:
        # What the pool will have free once the step's frees are done: blocks no one else holds.
        released: dict[int, int] = {}
        for request_id in request.free_request_ids:
            for block_id in self.manager.block_ids(request_id):
                released[block_id] = released.get(block_id, 0) + 1
        blocks = self.manager.block_pool.blocks
        bs = BLOCK_SIZE
        free = self.manager.num_free_blocks + sum(1 for b, n in released.items() if blocks[b].ref_cnt == n)
        needed = sum(max(0, -(-r.num_tokens // bs) - len(self.manager.block_ids(r.request_id))) for r in request.running)
        running_ids = [r.request_id for r in request.running]
        # The scheduler lists its running requests in priority order: oldest admission first (FCFS), or
        # by (priority, arrival).
        assert running_ids == sorted(running_ids, key=self.priority_of or self.admitted_order.__getitem__)
        result = self.manager.step(request)
        victims = result.preempted_request_ids
        if victims:
            # Preemption only when the pool truly could not grow every running request...
            assert needed > free, f"preempted {victims} with {free} free blocks for {needed} needed"
            # ...and the victims come from the tail: the newest (lowest priority) running requests first.
            assert victims == running_ids[::-1][: len(victims)]
            assert not any(w.request_id in result.new_block_ids for w in request.waiting)
        self.num_preemptions += len(victims)
        for w in request.waiting:
            if w.request_id in result.new_block_ids:
                self.admitted_order[w.request_id] = self.num_admissions
                self.num_admissions += 1
        return result


def expected_output(prompt: list[int], executor: CheckingExecutor) -> list[int]:
    """What an unconstrained run produces: the fake model's tokens from the whole sequence each time."""
    sequence = list(prompt)
    for _ in range(MAX_TOKENS):
        sequence.append(executor.next_token("", sequence))
    return sequence[len(prompt):]


class SharedPrefixQuarterPool(RuleBasedStateMachine):
    policy = "fcfs"
    steps_ahead = 1  # steps out at once (1: none planned ahead)

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, model_id="test")
        priority_of = None
        if self.policy == "priority":
            priority_of = lambda rid: (self.scheduler.requests[rid].priority, self.scheduler.requests[rid].arrival)  # noqa: E731
        self.observed = ObservedBlockManager(self.manager, priority_of)
        self.scheduler = Scheduler(
            SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=24, max_model_len=NUM_BLOCKS * BLOCK_SIZE,
                            scheduling_policy=self.policy),
            one_executor(self.observed.step),
        )
        self.executor = CheckingExecutor(self.manager, BLOCK_SIZE)
        self.loop = EngineLoop(self.scheduler, lambda step: CompletedCall(self.executor, step), lambda outputs: None,
                               lambda: "", self.steps_ahead > 1, steps_ahead=self.steps_ahead)
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.next_id = 0

    @precondition(lambda self: len(self.scheduler.requests) < MAX_CONCURRENT)
    @rule(prefix=st.integers(0, 2), prefix_blocks=st.integers(0, 4), suffix=st.lists(st.integers(0, EOS - 1), max_size=8),
          salt=st.sampled_from([None, "tenant-a", "tenant-b"]), priority=st.integers(0, 2))
    def add_request(self, prefix, prefix_blocks, suffix, salt, priority=0):
        prompt = PREFIXES[prefix][: prefix_blocks * BLOCK_SIZE] + suffix or [prefix]
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.scheduler.add_request(Request(
            request_id, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), (EOS,),
            self.scheduler.config.max_model_len, cache_salt=salt, priority=priority,
        ))
        self.prompts[request_id] = prompt
        self.outputs[request_id] = []

    @rule(num_steps=st.integers(1, 6))
    def step(self, num_steps):
        for _ in range(num_steps):
            self._record(self.loop.step())

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def cancel(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self._record([self.scheduler.abort_request(request_id)])

    def _record(self, outputs) -> None:
        for output in outputs:
            self.outputs[output.request_id].extend(output.new_token_ids)
            if output.finished:
                self.finish_reasons[output.request_id] = output.finish_reason

    @invariant()
    def every_block_is_accounted_for(self):
        pool = self.manager.block_pool
        cached_free = sum(1 for block in pool.free_block_queue if block.block_hash is not None)
        assert pool.num_free_blocks - cached_free + cached_free + pool.num_in_use == NUM_BLOCKS
        assert cached_free == pool.num_cached_evictable
        holders: dict[int, int] = {}
        for state in self.manager.requests.values():
            for block in state.blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id} miscounted"
        assert pool.num_in_use == len(holders)

    @invariant()
    def outputs_so_far_are_the_unconstrained_ones(self):
        for request_id, tokens in self.outputs.items():
            assert tokens == expected_output(self.prompts[request_id], self.executor)[: len(tokens)]

    def teardown(self):
        while self.loop.has_work():  # (the last step hands the last finished requests' blocks back)
            self._record(self.loop.step())
        for request_id, tokens in self.outputs.items():
            if self.finish_reasons[request_id] != "abort":
                assert self.finish_reasons[request_id] == "length"
                assert tokens == expected_output(self.prompts[request_id], self.executor)
        assert self.manager.num_requests == 0 and self.manager.block_pool.num_in_use == 0
        assert self.scheduler.num_preemptions == self.observed.num_preemptions == self.manager.num_preemptions


SharedPrefixQuarterPool.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSharedPrefixQuarterPool = SharedPrefixQuarterPool.TestCase


def machine(name: str, **attributes) -> type:
    """A variant of the machine above (policy, steps out: three lets a request be preempted with two samples
    it does not know yet), with its settings."""
    variant = type(name, (SharedPrefixQuarterPool,), attributes)
    variant.TestCase.settings = SharedPrefixQuarterPool.TestCase.settings
    return variant


SharedPrefixQuarterPoolByPriority = machine("SharedPrefixQuarterPoolByPriority", policy="priority")
SharedPrefixQuarterPoolPlannedAhead = machine("SharedPrefixQuarterPoolPlannedAhead", steps_ahead=2)
SharedPrefixQuarterPoolByPriorityPlannedAhead = machine("SharedPrefixQuarterPoolByPriorityPlannedAhead",
                                                        policy="priority", steps_ahead=2)
SharedPrefixQuarterPoolThreeAhead = machine("SharedPrefixQuarterPoolThreeAhead", steps_ahead=3)
SharedPrefixQuarterPoolByPriorityThreeAhead = machine("SharedPrefixQuarterPoolByPriorityThreeAhead",
                                                      policy="priority", steps_ahead=3)
TestSharedPrefixQuarterPoolByPriority = SharedPrefixQuarterPoolByPriority.TestCase
TestSharedPrefixQuarterPoolPlannedAhead = SharedPrefixQuarterPoolPlannedAhead.TestCase
TestSharedPrefixQuarterPoolByPriorityPlannedAhead = SharedPrefixQuarterPoolByPriorityPlannedAhead.TestCase
TestSharedPrefixQuarterPoolThreeAhead = SharedPrefixQuarterPoolThreeAhead.TestCase
TestSharedPrefixQuarterPoolByPriorityThreeAhead = SharedPrefixQuarterPoolByPriorityThreeAhead.TestCase


@pytest.mark.parametrize("machine_class", [SharedPrefixQuarterPool, SharedPrefixQuarterPoolByPriority,
                                           SharedPrefixQuarterPoolPlannedAhead,
                                           SharedPrefixQuarterPoolByPriorityPlannedAhead,
                                           SharedPrefixQuarterPoolThreeAhead,
                                           SharedPrefixQuarterPoolByPriorityThreeAhead])
def test_the_quarter_pool_does_preempt(machine_class):
    """The machines above are only meaningful if their pool really runs short: one fixed run shows it does."""
    machine = machine_class()
    for i in range(MAX_CONCURRENT):
        machine.add_request(prefix=i % 3, prefix_blocks=4, suffix=[i] * 8, salt=None, priority=i % 3)
    machine.teardown()
    assert machine.observed.num_preemptions > 0
