"""Preemption by swap: the block manager copies a preempted request's computed blocks to the swap space and
loads them back when it resumes, or has it recomputed (by mode, by the space left, by estimated cost). The
blocks add up, the copies are released whatever happens to the request, and with a fake executor that keeps
each token in its KV slot (tests/unit/test_scheduler.py), a copy of the wrong K/V would change the output."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from kvcache_svc.block_hash import block_hash
from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.step import BlockRequest, BlockStepRequest, BlockTransfer, ExecuteStep, num_loaded_tokens, one_executor
from scheduler_svc.scheduler import BlockManagerUnavailable, ExecutorUnavailable, Scheduler, SchedulerConfig
from tests.unit.test_scheduler import CheckingExecutor, add, random_prompts, run_to_completion
from tests.unit.test_step_failures import BLOCK_SIZE, Engine, FaultyExecutor, prompt

A_PROMPT = list(range(100, 110))  # 10 tokens: two full blocks of 4 and a partial one of 2


class Calls:
    """Drives a block manager as the scheduler does: numbered calls, each saying whether the last one ran."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.step_id = 0

    def __call__(self, ran: bool = True, **kwargs):
        # ran: the last call's step ran (and is reported); a step that did not run is given up once a later
        # one is reported run.
        executed = [self.step_id] if ran and self.step_id else []
        self.step_id += 1
        return self.manager.step(BlockStepRequest(step_id=self.step_id, executed_step_ids=executed,
                                                  planned_step_id=self.step_id - 1, **kwargs))


def admit(request_id: str, tokens: list[int], num_tokens: int | None = None) -> BlockRequest:
    return BlockRequest(request_id, len(tokens) if num_tokens is None else num_tokens, prompt_token_ids=tokens)


def preempt_a(**manager_kwargs) -> tuple[Calls, list[int], object]:
    """a (10 computed tokens in 3 blocks) is preempted for b, then c takes a's cached blocks; returns the
    calls, a's old block ids and the preempting call's result."""
    calls = Calls(KVCacheManager(6, 4, model_id="test", block_bytes=1000, **manager_kwargs))
    calls(waiting=[admit("a", A_PROMPT)])
    a_blocks = calls.manager.block_ids("a")
    calls(running=[BlockRequest("a", 10)], waiting=[admit("b", list(range(200, 212)))])
    # b needs a 4th block and the pool is empty: the tail of the running list, a, gives its blocks back.
    preempting = calls(running=[BlockRequest("b", 13), BlockRequest("a", 11, new_token_ids=[7], new_tokens_start=10)])
    assert preempting.preempted_request_ids == ["a"]
    calls(running=[BlockRequest("b", 13)], waiting=[admit("c", list(range(300, 308)))])  # evicts a's full blocks
    assert calls.manager.block_pool.cached_blocks.keys().isdisjoint(a_hashes(calls.manager))
    return calls, a_blocks, preempting


def a_hashes(manager: KVCacheManager) -> list[bytes]:
    first = block_hash(manager.root_hash, A_PROMPT[:4])
    second = block_hash(first, A_PROMPT[4:8])
    return [first, second, block_hash(second, A_PROMPT[8:10])]


def resume_a(calls: Calls):
    return calls(free_request_ids=["b", "c"], waiting=[admit("a", A_PROMPT + [7])])


def test_swap_copies_every_computed_block_and_the_resumed_request_loads_them_back():
    calls, a_blocks, preempting = preempt_a(preemption_mode="swap", swap_capacity_blocks=16)
    hashes = a_hashes(calls.manager)
    assert preempting.swap_out == [BlockTransfer(block_id, h) for block_id, h in zip(a_blocks, hashes)]
    assert calls.manager.stats()["swap_blocks_in_use"] == 3

    resumed = resume_a(calls)
    new_blocks = resumed.new_block_ids["a"]
    assert resumed.num_cached_tokens["a"] == 10  # only its newest token is computed
    assert resumed.tier_loads["a"] == [BlockTransfer(new_blocks[0], hashes[0]), BlockTransfer(new_blocks[1], hashes[1]),
                                       BlockTransfer(new_blocks[2], hashes[2], num_tokens=2)]
    assert resumed.swap_free == hashes  # freed after the step's loads
    stats = calls.manager.stats()
    assert (stats["num_swaps"], stats["blocks_swapped_out"], stats["blocks_swapped_in"], stats["swap_blocks_in_use"]) \
        == (1, 3, 3, 0)
    assert stats["num_preemptions"] == 1
    assert calls.manager.num_free_blocks == 6 - 3 and calls.manager.swapped == {}


@pytest.mark.parametrize(("kwargs", "swaps"), [
    ({"preemption_mode": "recompute", "swap_capacity_blocks": 16}, False),
    ({"preemption_mode": "swap", "swap_capacity_blocks": 2}, False),  # 3 blocks do not fit: recompute
    ({"preemption_mode": "swap", "swap_capacity_blocks": 3}, True),
    ({"preemption_mode": "swap"}, False),  # an executor without a swap space
    # auto: 10 tokens at 1,000 tokens/s against 6,000 bytes out and back at these speeds
    ({"preemption_mode": "auto", "swap_capacity_blocks": 16, "prefill_tokens_per_s": 1e3, "copy_bytes_per_s": 1e6},
     True),
    ({"preemption_mode": "auto", "swap_capacity_blocks": 16, "prefill_tokens_per_s": 1e3, "copy_bytes_per_s": 1e5},
     False),
    ({"preemption_mode": "auto", "swap_capacity_blocks": 16}, False),  # nothing measured: recompute
])
def test_swap_is_chosen_by_mode_space_and_estimated_cost(kwargs, swaps):
    calls, _, preempting = preempt_a(**kwargs)
    assert bool(preempting.swap_out) == swaps
    resumed = resume_a(calls)
    assert resumed.num_cached_tokens["a"] == (10 if swaps else 0)
    assert bool(resumed.tier_loads) == swaps
    assert calls.manager.num_swaps == int(swaps) and calls.manager.num_preemptions == 1


def test_the_copies_of_an_aborted_request_are_freed():
    calls, _, _ = preempt_a(preemption_mode="swap", swap_capacity_blocks=16)
    result = calls(free_request_ids=["a"])
    assert result.swap_free == a_hashes(calls.manager)
    assert calls.manager.swapped == {} and calls.manager.stats()["swap_blocks_in_use"] == 0
    assert calls().swap_free == []  # sent once, its step ran


def test_a_swap_whose_step_never_ran_is_recomputed_and_its_copies_freed():
    calls = Calls(KVCacheManager(6, 4, model_id="test", preemption_mode="swap", swap_capacity_blocks=16))
    calls(waiting=[admit("a", A_PROMPT)])
    calls(running=[BlockRequest("a", 10)], waiting=[admit("b", list(range(200, 212)))])
    preempting = calls(running=[BlockRequest("b", 13), BlockRequest("a", 11)])
    assert len(preempting.swap_out) == 3
    # That step never reached the executor: the copies may not exist. That is known once a later step is
    # reported run.
    unknown = calls(ran=False, running=[BlockRequest("b", 13)])
    assert unknown.swap_free == [] and "a" in calls.manager.swapped
    lost = calls(running=[BlockRequest("b", 13)])
    assert lost.swap_free == a_hashes(calls.manager) and calls.manager.swapped == {}
    calls(ran=False, running=[BlockRequest("b", 13)])
    again = calls(running=[BlockRequest("b", 13)])
    assert again.swap_free == a_hashes(calls.manager)  # the call that sent them did not run: sent again
    resumed = resume_a(calls)
    assert resumed.num_cached_tokens["a"] < 10 and not resumed.tier_loads.get("a")


def test_only_tokens_of_steps_that_ran_are_swapped():
    calls = Calls(KVCacheManager(4, 4, model_id="test", preemption_mode="swap", swap_capacity_blocks=16))
    tokens = A_PROMPT + list(range(6))
    calls(waiting=[admit("a", tokens, num_tokens=10)])  # a chunk of 10 of its 16 prompt tokens
    calls(running=[BlockRequest("a", 16)])  # the rest, in a step that never runs
    result = calls(ran=False, running=[BlockRequest("a", 17)])
    # a gives its 4 blocks back; only the 10 tokens of the step that ran are copied.
    assert result.preempted_request_ids == ["a"] and calls.manager.swapped["a"].num_tokens == 10
    assert [t.block_hash for t in result.swap_out] == a_hashes(calls.manager)
    calls(ran=False, free_request_ids=["a"])
    calls(waiting=[admit("b", list(range(400, 410)))])  # b's step never runs either
    result = calls(ran=False, running=[BlockRequest("b", 20)])
    assert result.preempted_request_ids == ["b"] and result.swap_out == [] and "b" not in calls.manager.swapped


def test_with_steps_planned_ahead_each_step_counts_once_reported_and_a_step_that_did_not_run_is_given_up():
    manager = KVCacheManager(4, 4, model_id="test", preemption_mode="swap", swap_capacity_blocks=16)

    def call(step_id: int, executed: list[int], received: int, **kwargs):
        return manager.step(BlockStepRequest(step_id=step_id, executed_step_ids=executed, planned_step_id=received,
                                             **kwargs))

    call(1, [], 0, waiting=[admit("a", A_PROMPT + list(range(6)), num_tokens=10)])
    call(2, [], 0, running=[BlockRequest("a", 16)])  # planned while step 1 is out
    # Step 1 is reported, step 2 is still out: a (preempted here) has the 10 tokens of step 1 computed.
    preempting = call(3, [1], 1, running=[BlockRequest("a", 17)])
    assert preempting.preempted_request_ids == ["a"] and manager.swapped["a"].num_tokens == 10
    assert [t.block_hash for t in preempting.swap_out] == a_hashes(manager)
    # Step 2 ran; step 3, which carried the copies, is still out: the swap stands.
    assert call(4, [2], 2).swap_free == [] and "a" in manager.swapped
    # Step 4 is reported run and step 3 is not: step 3 never ran, its copies may not exist.
    lost = call(5, [4], 4)
    assert lost.swap_free == a_hashes(manager) and manager.swapped == {}
    assert manager.stats()["swap_blocks_in_use"] == 0 and manager.num_free_blocks == 4


def test_requests_sharing_a_prefix_share_its_copies():
    calls = Calls(KVCacheManager(8, 4, model_id="test", preemption_mode="swap", swap_capacity_blocks=5))
    calls(waiting=[admit("a", A_PROMPT), admit("b", A_PROMPT[:8] + [5, 6])])
    calls(running=[BlockRequest("a", 10), BlockRequest("b", 10)])
    result = calls(running=[BlockRequest("a", 40), BlockRequest("b", 11)])
    assert result.preempted_request_ids == ["b", "a"]
    # b's two full blocks are a's (the prefix cache shares them); the partial blocks differ: 4 copies, not 6.
    assert len(result.swap_out) == 4 and calls.manager.stats()["swap_blocks_in_use"] == 4
    assert calls(free_request_ids=["a"]).swap_free == [a_hashes(calls.manager)[2]]  # b still needs the rest
    assert len(calls(free_request_ids=["b"]).swap_free) == 3


def test_a_restored_manager_resumes_a_swapped_request_as_the_original_would():
    calls, _, _ = preempt_a(preemption_mode="swap", swap_capacity_blocks=16)
    saved = json.loads(json.dumps(calls.manager.export_state()))
    restored = KVCacheManager(6, 4, model_id="test", block_bytes=1000, preemption_mode="swap", swap_capacity_blocks=16)
    restored.import_state(saved)
    assert restored.export_state() == saved
    twin = Calls(restored)
    twin.step_id = calls.step_id
    assert resume_a(twin) == resume_a(calls)
    assert restored.stats() == calls.manager.stats()


# ----------------------------------------------------------------------------- with a fake executor


class SwappingExecutor(CheckingExecutor):
    """Moves the fake K/V of whole blocks to host memory and back, as the executor's swap space does: a copy
    is taken before the step, loads fill blocks (every slot, as the real one does) and skip their tokens,
    and frees come after the loads."""

    def __init__(self, block_manager: KVCacheManager, block_size: int) -> None:
        super().__init__(block_manager, block_size)
        self.host: dict[bytes, list[int | None]] = {}

    def __call__(self, step: ExecuteStep):
        bs = self.block_size
        for t in step.swap_out:
            self.host[t.block_hash] = [self.slots.get(t.block_id * bs + j) for j in range(bs)]
        requests = []
        for req in step.requests:
            found = 0
            for t in req.load_blocks:
                if t.block_hash not in self.host:
                    break
                for j, token in enumerate(self.host[t.block_hash]):
                    self.slots[t.block_id * bs + j] = token
                found += 1
            skip = num_loaded_tokens(req.load_blocks[:found], bs)
            requests.append(dataclasses.replace(req, token_ids=req.token_ids[skip:],
                                                start_position=req.start_position + skip, load_blocks=[]))
        for block_hash_ in step.swap_free:
            self.host.pop(block_hash_, None)
        return super().__call__(dataclasses.replace(step, requests=requests))


PROMPTS = random_prompts(32, seed=0)
MAX_TOKENS = 32
BLOCKS_NEEDED = sum(-(-(len(p) + MAX_TOKENS) // 4) for p in PROMPTS)


def quarter_pool_run(num_blocks: int, **manager_kwargs):
    block_size = 4
    manager = KVCacheManager(num_blocks, block_size, **manager_kwargs)
    scheduler = Scheduler(SchedulerConfig(block_size=block_size, max_num_batched_tokens=64, max_model_len=512),
                          one_executor(manager.step))
    executor = SwappingExecutor(manager, block_size)
    for i, p in enumerate(PROMPTS):
        add(scheduler, f"r{i}", p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = run_to_completion(scheduler, executor, manager)
    scheduler.step(executor)  # an empty step hands the last finished requests' blocks back
    assert manager.num_free_blocks == num_blocks and manager.num_requests == 0
    assert executor.host == {} and manager.swapped == {} and manager.stats()["swap_blocks_in_use"] == 0
    return outputs, scheduler, manager


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_quarter_pool_outputs_equal_an_unconstrained_run_in_every_mode(mode):
    unconstrained, scheduler, _ = quarter_pool_run(BLOCKS_NEEDED)
    assert scheduler.num_preemptions == 0
    # auto: copying a block out and back costs what recomputing 3.96 tokens does (2 x block bytes x prefill
    # speed / copy speed): a request whose computed tokens fill whole blocks of 4 is swapped, one with a
    # partial last block mostly recomputed.
    outputs, scheduler, manager = quarter_pool_run(
        BLOCKS_NEEDED // 4, preemption_mode=mode, swap_capacity_blocks=10_000, block_bytes=1980,
        prefill_tokens_per_s=1000.0, copy_bytes_per_s=1e6)
    assert outputs == unconstrained and all(len(tokens) == MAX_TOKENS for tokens in outputs.values())
    assert scheduler.num_preemptions == manager.num_preemptions > 0
    if mode == "swap":
        assert manager.num_swaps == manager.num_preemptions
        assert manager.blocks_swapped_in > 0
    elif mode == "recompute":
        assert manager.num_swaps == 0
    else:
        assert 0 < manager.num_swaps < manager.num_preemptions


class SwappingFaultyExecutor(FaultyExecutor):
    def __init__(self, manager: KVCacheManager) -> None:
        super().__init__(manager)
        self.inner = SwappingExecutor(manager, BLOCK_SIZE)

    def restart(self) -> None:
        super().restart()
        self.inner = SwappingExecutor(self.manager, BLOCK_SIZE)


class SwapEngine(Engine):
    """The fault-injection engine of test_step_failures.py with a swapping block manager and executor, and
    one more fault: the block manager serves a call whose answer is lost on the way."""

    def __init__(self, num_blocks: int, seed: int, steps_ahead: int) -> None:
        super().__init__(num_blocks=num_blocks, steps_ahead=steps_ahead)
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE, model_id="test", preemption_mode="swap",
                                      swap_capacity_blocks=1000)
        self.executor = SwappingFaultyExecutor(self.manager)
        self.loop.execute, self.loop.executor_epoch = self.executor, self.executor.executor_epoch
        self.rng = random.Random(seed)
        self.fault_rate = 0.0

    def allocate(self, request):
        result = super().allocate(request)
        if self.rng.random() < self.fault_rate:
            raise BlockManagerUnavailable("the answer was lost")
        return result

    def step(self) -> None:
        if self.rng.random() < self.fault_rate:
            self.executor.fail_next.append(ExecutorUnavailable("UNAVAILABLE"))
        if self.rng.random() < self.fault_rate / 10:
            self.executor.restart()
        super().step()


@pytest.mark.parametrize("steps_ahead", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_no_fault_makes_a_swapped_request_load_kv_it_should_not(seed, steps_ahead):
    engine = SwapEngine(num_blocks=14, seed=seed, steps_ahead=steps_ahead)
    ids = [f"r{i}" for i in range(8)]
    for i, request_id in enumerate(ids):
        engine.add(request_id, prompt(60 + i, 9 + 3 * i))
    engine.fault_rate = 0.15
    engine.run()
    engine.fault_rate = 0.0
    engine.step()  # hands the last finished requests' blocks back
    assert engine.manager.num_swaps > 0
    engine.assert_fault_free_outputs(*ids)
    assert engine.manager.swapped == {} and engine.manager.num_free_blocks == 14
    assert engine.executor.inner.host == {}


def test_the_executor_reports_its_swap_space_and_costs_and_the_block_manager_takes_them(tiny_llama_dir):
    from executor_svc.model_runner import ModelRunner
    from executor_svc.server import executor_info
    from kvcache_svc.build import build_block_manager
    from pagedserve.config import CacheConfig, ModelConfig

    cache = CacheConfig(kv_cache_memory=1 << 20, swap_host_bytes=1 << 20, preemption_mode="swap")
    runner = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu", dtype="float32"), cache)
    info = executor_info(runner)
    assert info.swap_capacity_blocks == (1 << 20) // runner.block_bytes > 0
    assert info.prefill_tokens_per_s > 0 and info.copy_bytes_per_s > 0
    assert all(k.abs().sum() == 0 for kv in runner.kv_caches for k in kv)  # the copy probe left the pool as it was
    manager = build_block_manager(cache, info)
    assert (manager.preemption_mode, manager.swap_capacity_blocks) == ("swap", info.swap_capacity_blocks)
    assert (manager.prefill_tokens_per_s, manager.copy_bytes_per_s) == (info.prefill_tokens_per_s,
                                                                         info.copy_bytes_per_s)
