"""Several executors behind the KV-cache service: one pool per executor, routing of new requests (longest
cached prefix, ties to the least loaded, or round-robin), registrations that expire, and an executor's loss."""
from __future__ import annotations

import random

import pytest

from kvcache_svc.executor_pools import ExecutorPools, ExecutorRefused, ExecutorRegistration, NoExecutor
from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.config import SchedulerConfig
from pagedserve.step import BlockRequest, BlockStepRequest, ExecuteStep, merge_results
from scheduler_svc.engine_loop import CompletedCall, EngineLoop
from scheduler_svc.scheduler import Scheduler
from tests.unit.test_scheduler import CheckingExecutor, add

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def registration(address: str, epoch: str = "1", model: str = "m", num_blocks: int = 16,
                 block_size: int = BLOCK) -> ExecutorRegistration:
    return ExecutorRegistration(address, epoch, model, num_blocks, block_size)


def make_pools(*addresses: str, routing: str = "kv", num_blocks: int = 16, clock=None) -> ExecutorPools:
    pools = ExecutorPools(lambda r: KVCacheManager(r.num_blocks, r.block_size, model_id=r.model_fingerprint),
                          routing, heartbeat_ttl_s=3.0, clock=clock or Clock())
    for address in addresses:
        pools.register(registration(address, num_blocks=num_blocks))
    return pools


def admit(request_id: str, prompt: list[int]) -> BlockRequest:
    return BlockRequest(request_id, len(prompt), prompt_token_ids=prompt)


class Driver:
    """Plays the scheduler: numbers the steps and reports each one run, so that filled blocks are indexed."""

    def __init__(self, pools: ExecutorPools) -> None:
        self.pools, self.step_id, self.where = pools, 0, {}

    def step(self, waiting=(), free=(), running=()):
        self.step_id += 1
        results = self.pools.step(BlockStepRequest(
            scheduler_id="s", step_id=self.step_id, planned_step_id=self.step_id - 1,
            executed_step_ids=[self.step_id - 1] if self.step_id > 1 else [], free_request_ids=list(free),
            waiting=list(waiting),
            running=[BlockRequest(rid, n, executor_id=self.where[rid]) for rid, n in running]))
        for address, result in results.items():
            for request_id in result.new_block_ids:
                self.where.setdefault(request_id, address)
        return results

    def placed(self, request_id: str) -> str:
        return self.where[request_id]


def prompt(prefix: int, suffix: int) -> list[int]:
    """Three full blocks shared by a prefix, then a block of its own."""
    return [100 + prefix] * (3 * BLOCK) + [200 + suffix] * BLOCK


def test_one_executor_serves_requests_that_name_none():
    pools = make_pools("a:1")
    driver = Driver(pools)
    results = driver.step(waiting=[admit("r", prompt(0, 0))])
    assert list(results) == ["a:1"] and results["a:1"].new_block_ids["r"] == [0, 1, 2, 3]
    # The scheduler of one executor does not name it.
    grown = pools.step(BlockStepRequest(scheduler_id="s", step_id=2, planned_step_id=1, running=[BlockRequest("r", 17)]))
    assert grown["a:1"].new_block_ids["r"] == [4]


def test_requests_sharing_a_prefix_land_on_the_executor_that_holds_it():
    pools = make_pools("a:1", "b:1")
    driver = Driver(pools)
    driver.step(waiting=[admit("p0", prompt(0, 0)), admit("p1", prompt(1, 0))])
    # Ties (nothing cached) go to the least loaded: the two prefixes are spread.
    assert driver.placed("p0") != driver.placed("p1")
    driver.step()  # reports the first step run: the prefixes are indexed
    for suffix in range(1, 6):
        driver.step(waiting=[admit(f"p1-{suffix}", prompt(1, suffix)), admit(f"p0-{suffix}", prompt(0, suffix))])
        assert driver.placed(f"p0-{suffix}") == driver.placed("p0")
        assert driver.placed(f"p1-{suffix}") == driver.placed("p1")
    stats = pools.stats()
    assert sum(s["prefix_cache_hits"] for s in stats.values()) == 10 * 3 * BLOCK


def test_ties_go_to_the_least_loaded_executor():
    pools = make_pools("a:1", "b:1")
    driver = Driver(pools)
    driver.step(waiting=[admit("big", list(range(40)))])  # 10 of a's 16 blocks
    driver.step(running=[("big", 40)])
    results = driver.step(running=[("big", 40)], waiting=[admit(f"r{i}", [500 + i] * 8) for i in range(3)])
    loaded = driver.placed("big")
    other = next(a for a in results if a != loaded)
    # Each newcomer takes 2 blocks: the other executor stays less loaded until it holds more than 10.
    assert {driver.placed(f"r{i}") for i in range(3)} == {other}


def test_a_longer_prefix_beats_a_lighter_load():
    pools = make_pools("a:1", "b:1")
    driver = Driver(pools)
    driver.step(waiting=[admit("p", prompt(0, 0))])
    holder = driver.placed("p")
    driver.step(running=[("p", 16)])
    driver.step(running=[("p", 16)], waiting=[admit("q", prompt(0, 1))])
    assert driver.placed("q") == holder


def test_round_robin_ignores_the_cache():
    pools = make_pools("a:1", "b:1", routing="round_robin")
    driver = Driver(pools)
    driver.step(waiting=[admit("p", prompt(0, 0))])
    driver.step()
    driver.step(waiting=[admit(f"q{i}", prompt(0, i + 1)) for i in range(4)])
    assert [driver.placed(f"q{i}") for i in range(4)] == ["b:1", "a:1", "b:1", "a:1"]


def test_block_counts_of_the_pools_add_up_and_a_dropped_executor_frees_exactly_its_blocks():
    pools = make_pools("a:1", "b:1")
    driver = Driver(pools)
    driver.step(waiting=[admit(f"r{i}", [300 + i] * (BLOCK * (i + 1))) for i in range(4)])
    stats = pools.stats()
    on = {address: [r for r in driver.where if driver.where[r] == address] for address in stats}
    for address, s in stats.items():
        held = sum(len(pools.pools[address].manager.block_ids(r)) for r in on[address])
        assert s["num_in_use"] == held and s["num_free_blocks"] == 16 - held
    assert sum(s["num_in_use"] for s in stats.values()) == 1 + 2 + 3 + 4
    lost = driver.placed("r3")
    survivor = next(a for a in stats if a != lost)
    before = pools.stats()[survivor]
    pools.clock.now = 10.0  # long after start-up: an executor not registered is gone, not late
    assert not pools.drop(lost, epoch="0")  # another instance than the one registered: kept
    assert pools.drop(lost, epoch="1")
    assert pools.stats() == {survivor: before}  # the survivor's pool is untouched
    # The lost executor's requests are reported preempted (the scheduler re-admits them), the others served.
    results = driver.step(running=[(r, BLOCK * (int(r[1]) + 1)) for r in sorted(driver.where)])
    assert list(results) == [survivor]
    assert sorted(results[survivor].preempted_request_ids) == sorted(on[lost])
    assert set(results[survivor].new_block_ids) == set(on[survivor])


def test_registrations_expire_without_heartbeats_and_a_new_epoch_starts_an_empty_pool():
    clock = Clock()
    pools = make_pools("a:1", "b:1", clock=clock)
    driver = Driver(pools)
    driver.step(waiting=[admit("r", prompt(0, 0))])
    holder = driver.placed("r")
    clock.now = 2.0
    assert not pools.register(registration("a:1"))  # a heartbeat
    clock.now = 4.0
    assert pools.expire() == ["b:1"]
    assert [r.address for r in pools.executors()] == ["a:1"]
    assert pools.register(registration("a:1", epoch="2"))  # restarted
    assert pools.pools["a:1"].manager.num_requests == 0
    results = driver.step(running=[("r", 16)])
    assert results["a:1"].preempted_request_ids == ["r"] and holder in ("a:1", "b:1")


def test_after_a_restart_a_step_waits_for_the_executors_to_register_again():
    clock = Clock()
    pools = make_pools("a:1", clock=clock)  # b:1 has not beaten since this service started
    running = BlockStepRequest(running=[BlockRequest("r", 4, executor_id="b:1")])
    with pytest.raises(NoExecutor, match="b:1 has not registered again"):
        pools.step(running)
    clock.now = 3.5  # a heartbeat period on: it is gone, and its requests are recomputed
    assert pools.step(running)["a:1"].preempted_request_ids == ["r"]


def test_another_model_or_block_size_is_refused_with_a_clear_error():
    pools = make_pools("a:1")
    with pytest.raises(ExecutorRefused, match="same model and block size"):
        pools.register(registration("b:1", model="other"))
    with pytest.raises(ExecutorRefused, match="blocks of 8 tokens"):
        pools.register(registration("b:1", block_size=8))
    assert [r.address for r in pools.executors()] == ["a:1"]
    pools.register(registration("a:1", epoch="2", model="other"))  # the only one may change its model


def test_several_executors_need_running_requests_to_name_theirs_and_none_is_unavailable():
    pools = make_pools("a:1", "b:1")
    with pytest.raises(ValueError, match="must name its executor"):
        pools.step(BlockStepRequest(running=[BlockRequest("r", 4)]))
    with pytest.raises(NoExecutor):
        make_pools().step(BlockStepRequest())
    with pytest.raises(ValueError, match="routing"):
        make_pools(routing="random")


def run_split(num_executors: int, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], ExecutorPools, dict]:
    """The real scheduler and engine loop over `num_executors` pools, each executor a CheckingExecutor (which
    reads every token back through its own pool's block tables, so a request planned on one executor's blocks
    and run on another's changes its output); each step's parts run on their executors."""
    pools = make_pools(*[f"e{i}:1" for i in range(num_executors)], num_blocks=64)
    executors = {address: CheckingExecutor(pool.manager, BLOCK) for address, pool in pools.pools.items()}
    calls = {"kv": 0}

    def allocate(request):
        calls["kv"] += 1
        return pools.step(request)

    def execute(step: ExecuteStep):
        parts = step.parts or [step]
        assert sorted(p.executor_id for p in parts) == sorted(executors), "one part per executor, every step"
        for part in parts:
            for row in part.requests:  # each row goes where its blocks are
                assert pools.pools[part.executor_id].manager.block_ids(row.request_id)
        return merge_results([executors[part.executor_id](part) for part in parts])

    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK, max_num_batched_tokens=32, max_model_len=256), allocate)
    loop = EngineLoop(scheduler, lambda step: CompletedCall(execute, step), lambda outputs: None, lambda: "")
    outputs = {request_id: [] for request_id in prompts}
    for request_id, prompt in prompts.items():
        add(scheduler, request_id, prompt, temperature=0, max_tokens=6, ignore_eos=True)
    steps = 0
    while loop.has_work():
        for output in loop.step():
            outputs[output.request_id].extend(output.new_token_ids)
        steps += 1
    # One KV call per step, however many executors, but for steps planned on slots reserved ahead.
    assert calls["kv"] + scheduler.num_calls_skipped == loop.num_steps == steps
    return outputs, pools, executors


def test_a_step_split_over_executors_gives_the_outputs_of_one_executor():
    rng = random.Random(3)
    prefixes = [[rng.randrange(1, 90) for _ in range(3 * BLOCK)] for _ in range(4)]
    prompts = {f"p{p}-{s}": prefixes[p] + [rng.randrange(1, 90) for _ in range(rng.randint(1, 6))]
               for p in range(4) for s in range(4)}
    alone, _, _ = run_split(1, prompts)
    split, pools, executors = run_split(2, prompts)
    assert split == alone
    assert all(executor.steps and any(s.requests for s in executor.steps) for executor in executors.values())
    assert all(pool.manager.num_requests == 0 for pool in pools.pools.values())
