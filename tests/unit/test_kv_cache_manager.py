"""The block manager's step: running requests grown in order and preempted from the tail, waiting requests
admitted in order; every block accounted for."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.step import BlockRequest, BlockStepRequest


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"num_blocks": 0, "block_size": 16}, "num_blocks"), ({"num_blocks": 4, "block_size": -1}, "block_size"),
     ({"num_blocks": 4.0, "block_size": 16}, "num_blocks"), ({"num_blocks": 4, "block_size": True}, "block_size")],
)
def test_rejects_bad_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        KVCacheManager(**kwargs)


def admit(request_id: str, num_tokens: int, prompt: list[int] | None = None, **kwargs) -> BlockRequest:
    return BlockRequest(request_id, num_tokens, prompt_token_ids=prompt or list(range(num_tokens)), **kwargs)


def test_growth_returns_only_the_new_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=16, enable_prefix_caching=False)
    first = manager.step(BlockStepRequest(waiting=[admit("a", 1)]))
    assert (first.new_block_ids, first.num_cached_tokens) == ({"a": [0]}, {"a": 0})
    grow = lambda n: manager.step(BlockStepRequest(running=[BlockRequest("a", n)])).new_block_ids["a"]
    assert grow(16) == []
    assert grow(17) == [1]
    assert grow(10) == []  # shrinking never gives blocks back
    assert manager.step(BlockStepRequest(waiting=[admit("b", 33)])).new_block_ids == {"b": [2, 3, 4]}
    assert manager.block_ids("a") == [0, 1] and manager.block_ids("b") == [2, 3, 4]
    assert (manager.num_requests, manager.num_free_blocks, manager.usage) == (2, 3, 5 / 8)
    assert manager.slot_usage() == (17 + 33, 5 * 16)


def test_step_frees_before_it_allocates():
    manager = KVCacheManager(num_blocks=3, block_size=16)
    manager.step(BlockStepRequest(waiting=[admit("a", 48)]))
    result = manager.step(BlockStepRequest(free_request_ids=["a", "never-seen"], waiting=[admit("b", 48, [7] * 48)]))
    assert sorted(result.new_block_ids["b"]) == [0, 1, 2] and result.preempted_request_ids == []
    assert manager.block_ids("a") == []


def test_short_pool_preempts_the_tail_of_the_running_list():
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    manager.step(BlockStepRequest(waiting=[admit("old", 4), admit("mid", 4), admit("new", 4)]))
    assert manager.num_free_blocks == 1
    # old and mid each need a block; only one is free: the newest running request gives its block back.
    result = manager.step(BlockStepRequest(running=[BlockRequest("old", 5), BlockRequest("mid", 5), BlockRequest("new", 4)]))
    assert result.preempted_request_ids == ["new"]
    assert result.new_block_ids == {"old": [3], "mid": [2]}
    assert manager.num_free_blocks == 0 and manager.num_requests == 2
    # Nobody is admitted in a step that preempted, even if a block came free.
    manager.step(BlockStepRequest(free_request_ids=["mid"]))
    result = manager.step(BlockStepRequest(running=[BlockRequest("old", 20)], waiting=[admit("w", 1)]))
    assert result.preempted_request_ids == ["old"] and result.new_block_ids == {}
    assert manager.num_free_blocks == 4 and manager.num_requests == 0


def test_a_request_too_big_to_grow_preempts_itself_last():
    manager = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    manager.step(BlockStepRequest(waiting=[admit("a", 4), admit("b", 4)]))
    result = manager.step(BlockStepRequest(running=[BlockRequest("a", 4), BlockRequest("b", 13)]))
    # b needs 3 more blocks; freeing b itself is all the tail can give: a keeps its table.
    assert result.preempted_request_ids == ["b"] and result.new_block_ids == {"a": []}
    assert manager.block_ids("a") == [0]


def test_admission_stops_at_the_first_waiting_request_that_does_not_fit():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    result = manager.step(BlockStepRequest(waiting=[admit("a", 40), admit("big", 40, [5] * 40), admit("c", 1, [9])]))
    assert result.new_block_ids == {"a": [0, 1, 2]}  # c would fit, but FCFS: it waits behind big
    assert manager.num_requests == 1


def test_an_unknown_running_request_is_preempted_to_be_recomputed():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    result = manager.step(BlockStepRequest(running=[BlockRequest("lost", 9)], waiting=[admit("w", 2)]))
    assert result.preempted_request_ids == ["lost"] and result.new_block_ids == {}


def test_stats_reports_the_pool():
    manager = KVCacheManager(num_blocks=4, block_size=8)
    manager.step(BlockStepRequest(waiting=[admit("a", 9)]))
    assert manager.stats() == {
        "num_blocks": 4,
        "num_free_blocks": 2,
        "num_in_use": 2,
        "num_cached_evictable": 0,
        "num_requests": 1,
        "usage": 0.5,
        "num_preemptions": 0,
        "prefix_cache_queries": 9,
        "prefix_cache_hits": 0,
        "evictions": 0,
        "tier_hits": 0,
        "blocks_saved": 0,
        "bytes_moved": 0,
        "num_swaps": 0,
        "blocks_swapped_out": 0,
        "blocks_swapped_in": 0,
        "swap_blocks_in_use": 0,
        "tier_index_blocks": 0,
        "tier_errors": 0,
    }


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free"]), st.sampled_from("abcde"), st.integers(1, 70)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_random_requests_never_share_or_lose_blocks(ops):
    manager = KVCacheManager(num_blocks=10, block_size=8, enable_prefix_caching=False)
    running: list[str] = []  # admission order
    for op, request_id, num_tokens in ops:
        if op == "free":
            manager.step(BlockStepRequest(free_request_ids=[request_id]))
            running = [r for r in running if r != request_id]
        elif op == "admit" and request_id not in running:
            result = manager.step(BlockStepRequest(waiting=[admit(request_id, num_tokens)]))
            if request_id in result.new_block_ids:
                running.append(request_id)
        elif op == "grow" and request_id in running:
            before = manager.block_ids(request_id)
            result = manager.step(BlockStepRequest(running=[BlockRequest(r, num_tokens if r == request_id else 0)
                                                            for r in running]))
            # Victims come off the tail, newest first, and only as many as the growth needed.
            victims = result.preempted_request_ids
            assert victims == running[len(running) - len(victims):][::-1]
            running = running[: len(running) - len(victims)]
            if request_id in running:
                assert manager.block_ids(request_id) == before + result.new_block_ids[request_id]
        tables = [manager.block_ids(rid) for rid in "abcde"]
        held = [block_id for table in tables for block_id in table]
        assert len(held) == len(set(held))
        assert len(held) + manager.num_free_blocks == manager.num_blocks
        assert sorted(running) == sorted(manager.requests)


# ----------------------------------------------------------------------------- indexing only what ran


def test_blocks_are_indexed_once_their_step_is_reported_run_even_two_calls_on():
    """Steps planned ahead: the call that plans step 3 reports step 1 run; step 2's blocks wait for it."""
    manager = KVCacheManager(num_blocks=16, block_size=4)
    manager.step(BlockStepRequest(step_id=1, waiting=[admit("a", 9, list(range(9)))]))  # fills blocks 0, 1
    manager.step(BlockStepRequest(step_id=2, planned_step_id=1, running=[
        BlockRequest("a", 13, new_token_ids=[9, 10, 11], new_tokens_start=9)]))  # fills block 2
    assert manager.block_pool.cached_blocks == {}
    manager.step(BlockStepRequest(step_id=3, planned_step_id=2, executed_step_ids=[1], running=[BlockRequest("a", 13)]))
    assert len(manager.block_pool.cached_blocks) == 2
    manager.step(BlockStepRequest(step_id=4, planned_step_id=3, executed_step_ids=[2], running=[BlockRequest("a", 13)]))
    assert len(manager.block_pool.cached_blocks) == 3
    assert len(manager.requests["a"].block_hashes) == 3


def test_a_step_that_did_not_run_gets_its_blocks_named_again_and_indexed_by_one_that_did():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    manager.step(BlockStepRequest(step_id=1, waiting=[admit("a", 9, list(range(9)))]))
    manager.step(BlockStepRequest(step_id=2, planned_step_id=1, running=[BlockRequest("a", 9)]))
    # Step 1 failed (it is not among the steps that ran), step 2 ran: nothing is indexed yet, because step 2
    # named no block (step 1 had named them); the next call names them again, and they are indexed once
    # that call's step has run.
    manager.step(BlockStepRequest(step_id=3, planned_step_id=2, executed_step_ids=[2], running=[BlockRequest("a", 9)]))
    assert manager.block_pool.cached_blocks == {}
    manager.step(BlockStepRequest(step_id=4, planned_step_id=3, executed_step_ids=[3], running=[BlockRequest("a", 9)]))
    assert len(manager.block_pool.cached_blocks) == 2


def test_with_two_calls_out_each_filled_block_is_written_through_once():
    from kvcache_svc.offload_index import LocalTierIndex

    manager = KVCacheManager(num_blocks=16, block_size=4, tier=LocalTierIndex(64), write_through=True)
    first = manager.step(BlockStepRequest(step_id=1, waiting=[admit("a", 9, list(range(9)))]))
    second = manager.step(BlockStepRequest(step_id=2, planned_step_id=1, running=[
        BlockRequest("a", 13, new_token_ids=[9, 10, 11], new_tokens_start=9)]))
    third = manager.step(BlockStepRequest(step_id=3, planned_step_id=2, executed_step_ids=[1],
                                          running=[BlockRequest("a", 14, new_token_ids=[12], new_tokens_start=12)]))
    saved = [t.block_id for result in (first, second, third) for t in result.saves_after]
    assert saved == manager.block_ids("a")[:3]


def test_lookahead_reserves_a_block_ahead_for_each_running_request_and_says_how_many_slots_each_holds():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    admitted = manager.step(BlockStepRequest(waiting=[admit("a", 3), admit("b", 4)], lookahead_slots=4))
    # Admission gives what the prompt needs, nothing ahead: reservations are for running requests.
    assert admitted.new_block_ids == {"a": [0], "b": [1]} and admitted.num_slots == {"a": 4, "b": 4}
    grown = manager.step(BlockStepRequest(running=[BlockRequest("a", 4), BlockRequest("b", 5)], lookahead_slots=4))
    # Needs first (b's fifth slot: block 2), then a block ahead each: a holds 8 slots, b 12.
    assert grown.new_block_ids == {"a": [3], "b": [2, 4]}
    assert grown.num_slots == {"a": 8, "b": 12}
    # Within what they hold, nothing changes and no answer names a slot count.
    again = manager.step(BlockStepRequest(running=[BlockRequest("a", 4), BlockRequest("b", 8)], lookahead_slots=4))
    assert again.new_block_ids == {"a": [], "b": []} and again.num_slots == {}
    assert manager.slot_usage() == (12, 20) and manager.num_free_blocks == 11
    # One slot on, a has fewer than 4 ahead: it gets another block.
    again = manager.step(BlockStepRequest(running=[BlockRequest("a", 5), BlockRequest("b", 8)], lookahead_slots=4))
    assert again.new_block_ids == {"a": [5], "b": []} and again.num_slots == {"a": 12}


def test_lookahead_keeps_a_quarter_of_the_pool_free_and_never_costs_a_need():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    manager.step(BlockStepRequest(waiting=[admit(r, 4) for r in "abcd"]))
    # 4 free, of which a quarter of the pool (2) stays free: a and b get a block ahead, c and d, last, none.
    result = manager.step(BlockStepRequest(running=[BlockRequest(r, 4) for r in "abcd"], lookahead_slots=4))
    assert result.new_block_ids == {"a": [4], "b": [5], "c": [], "d": []} and manager.num_free_blocks == 2
    # A waiting request is admitted before anything is reserved: e takes the last 2 blocks, and nobody
    # waits or is preempted for a reservation.
    result = manager.step(BlockStepRequest(running=[BlockRequest(r, 4) for r in "abcd"], waiting=[admit("e", 8)],
                                           lookahead_slots=4))
    assert result.new_block_ids == {"a": [], "b": [], "c": [], "d": [], "e": [6, 7]}
    assert not result.preempted_request_ids and manager.num_free_blocks == 0


def test_no_lookahead_is_reserved_in_a_step_that_preempts():
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    manager.step(BlockStepRequest(waiting=[admit("a", 4), admit("b", 4), admit("c", 4)]))
    result = manager.step(BlockStepRequest(running=[BlockRequest("a", 5), BlockRequest("b", 5), BlockRequest("c", 4)],
                                           lookahead_slots=8))
    assert result.preempted_request_ids == ["c"]
    assert result.num_slots == {"a": 8, "b": 8} and manager.num_free_blocks == 0
