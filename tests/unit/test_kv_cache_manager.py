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


def test_allocate_returns_only_the_new_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=16)
    assert manager.num_blocks_needed("a", 1) == 1
    assert manager.allocate("a", 1) == [0]
    assert manager.num_blocks_needed("a", 16) == 0
    assert manager.allocate("a", 16) == []
    assert manager.allocate("a", 17) == [1]
    assert manager.allocate("a", 10) == []  # shrinking never gives blocks back
    assert manager.allocate("b", 33) == [2, 3, 4]
    assert manager.block_ids("a") == [0, 1]
    assert manager.block_ids("b") == [2, 3, 4]
    assert (manager.num_requests, manager.num_free_blocks, manager.usage) == (2, 3, 5 / 8)


def test_admission_with_zero_tokens_registers_the_request():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    assert manager.allocate("a", 0) == []
    assert manager.num_requests == 1
    assert manager.block_ids("a") == []


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    manager.allocate("a", 40)  # 3 blocks
    before = manager.stats()
    assert not manager.can_allocate("a", 80)
    assert manager.allocate("a", 80) is None  # needs 2 more, 1 free
    assert manager.allocate("b", 17) is None
    assert manager.stats() == before
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.block_ids("b") == []
    # The failed growth did not raise the request's slotted token count either.
    assert manager.can_grow_all(["a"])
    assert manager.can_allocate("a", 64)


def test_free_returns_blocks_and_is_idempotent():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    manager.allocate("a", 48)
    manager.free("a")
    assert (manager.num_free_blocks, manager.num_requests, manager.block_ids("a")) == (4, 0, [])
    manager.free("a")
    manager.free("never-seen")
    assert manager.num_free_blocks == 4
    # A freed id is admitted again from scratch; its blocks went back last-first, behind the never-used one.
    assert manager.allocate("a", 64) == [3, 2, 1, 0]


def test_can_grow_all_counts_requests_whose_last_block_is_full():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    manager.allocate("full", 4)  # last block full: needs a new one to append
    manager.allocate("room", 5)  # 3 of 8 slots free in its last block
    assert manager.num_free_blocks == 1
    assert manager.can_grow_all(["full", "room"])
    assert manager.can_grow_all(["new"])  # holds no block: needs one
    assert not manager.can_grow_all(["full", "new"])
    manager.allocate("room", 8)
    assert not manager.can_grow_all(["full", "room"])
    assert manager.can_grow_all([])


def test_step_frees_before_it_allocates():
    manager = KVCacheManager(num_blocks=3, block_size=16)
    manager.allocate("a", 48)
    result = manager.step(BlockStepRequest(free_request_ids=["a"], requests=[BlockRequest("b", 48)]))
    assert result.failed_request_ids == []
    assert sorted(result.new_block_ids["b"]) == [0, 1, 2]
    assert result.num_free_blocks == 0
    assert manager.block_ids("a") == []


def test_step_serves_in_order_reports_failures_and_returns_deltas():
    manager = KVCacheManager(num_blocks=4, block_size=16)
    first = manager.step(BlockStepRequest(requests=[BlockRequest("a", 16, prompt_token_ids=list(range(16)))]))
    assert first.new_block_ids == {"a": [0]}
    assert first.num_cached_tokens == {"a": 0}
    assert first.num_free_blocks == 3

    result = manager.step(
        BlockStepRequest(
            requests=[
                BlockRequest("a", 16),  # no new slot needed: an empty delta, still reported
                BlockRequest("b", 40, prompt_token_ids=list(range(40)), cache_salt="tenant"),  # 3 blocks
                BlockRequest("c", 1, prompt_token_ids=[7]),  # pool is empty by now
                BlockRequest("a", 17),
            ]
        )
    )
    assert result.new_block_ids == {"a": [], "b": [1, 2, 3]}
    assert result.num_cached_tokens == {"b": 0}  # only admissions carry a cached count
    assert result.failed_request_ids == ["c", "a"]
    assert result.num_free_blocks == 0
    assert manager.block_ids("a") == [0]
    assert manager.block_ids("c") == []
    assert manager.num_requests == 2


def test_stats_reports_the_pool():
    manager = KVCacheManager(num_blocks=4, block_size=8)
    manager.allocate("a", 9)
    assert manager.stats() == {
        "num_blocks": 4,
        "num_free_blocks": 2,
        "num_in_use": 2,
        "num_cached_evictable": 0,
        "num_requests": 1,
        "usage": 0.5,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "evictions": 0,
        "tier_hits": 0,
        "blocks_saved": 0,
        "bytes_moved": 0,
        "tier_index_blocks": 0,
        "tier_errors": 0,
    }


ops = st.lists(
    st.tuples(st.sampled_from(["allocate", "free", "step"]), st.sampled_from("abcde"), st.integers(0, 70)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_random_requests_never_share_or_lose_blocks(ops):
    manager = KVCacheManager(num_blocks=10, block_size=8)
    for op, request_id, num_tokens in ops:
        before = manager.block_ids(request_id)
        if op == "allocate":
            new = manager.allocate(request_id, num_tokens)
            assert manager.block_ids(request_id) == (before if new is None else before + new)
        elif op == "free":
            manager.free(request_id)
        else:
            result = manager.step(BlockStepRequest(requests=[BlockRequest(request_id, num_tokens)]))
            assert (request_id in result.failed_request_ids) != (request_id in result.new_block_ids)
            assert result.num_free_blocks == manager.num_free_blocks
        tables = [manager.block_ids(rid) for rid in "abcde"]
        held = [block_id for table in tables for block_id in table]
        assert len(held) == len(set(held))
        assert len(held) + manager.num_free_blocks == manager.num_blocks
        for rid, table in zip("abcde", tables):
            assert len(table) == -(-manager.num_tokens.get(rid, 0) // manager.block_size)
