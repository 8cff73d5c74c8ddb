from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache_svc.block_pool import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


# --------------------------------------------------------------------------- FreeBlockQueue


def test_queue_starts_in_id_order_and_pops_from_the_head():
    queue = FreeBlockQueue([KVBlock(i) for i in range(4)])
    assert len(queue) == 4
    assert ids(queue) == [0, 1, 2, 3]
    assert queue.popleft().block_id == 0
    assert ids(queue.popleft_n(2)) == [1, 2]
    assert ids(queue) == [3]
    assert len(queue) == 1


def test_queue_remove_from_middle_and_append_to_tail():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.append(blocks[2])
    assert ids(queue) == [0, 1, 3, 4, 2]
    queue.remove(blocks[0])
    queue.remove(blocks[2])  # the last one
    queue.append_n([blocks[2], blocks[0]])
    assert ids(queue) == [1, 3, 4, 2, 0]
    assert len(queue) == 5


def test_queue_rejects_popping_or_removing_what_it_does_not_hold():
    blocks = [KVBlock(i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    with pytest.raises(IndexError):
        queue.popleft_n(3)
    assert len(queue) == 2
    queue.popleft_n(2)
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[0])


# --------------------------------------------------------------------------- BlockPool


def test_pool_counts_follow_allocation_and_free():
    pool = BlockPool(8)
    assert (pool.num_blocks, pool.num_free_blocks, pool.num_in_use, pool.usage) == (8, 8, 0, 0.0)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert all(block.ref_cnt == 1 for block in blocks)
    assert (pool.num_free_blocks, pool.num_in_use, pool.usage) == (5, 3, 3 / 8)
    pool.free_blocks(reversed(blocks))
    assert (pool.num_free_blocks, pool.num_in_use) == (8, 0)
    assert all(block.ref_cnt == 0 for block in blocks)


def test_pool_rejects_over_allocation_without_taking_anything():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_rejects_a_double_free():
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError):
        pool.free_blocks([block])
    assert pool.num_free_blocks == 2


def test_touch_takes_an_evictable_cached_block_out_of_the_free_queue():
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    assert pool.cache_full_block(block, b"h0")
    pool.free_blocks([block])
    assert pool.num_cached_evictable == 1
    assert block in list(pool.free_block_queue)

    hit = pool.get_cached_block(b"h0")
    assert hit is block
    pool.touch([hit])
    assert block.ref_cnt == 1
    assert block not in list(pool.free_block_queue)
    assert (pool.num_free_blocks, pool.num_cached_evictable, pool.num_in_use) == (3, 0, 1)
    # An in-use block touched again just gains an owner.
    pool.touch([block])
    assert block.ref_cnt == 2
    assert pool.num_free_blocks == 3


def test_reusing_a_cached_block_evicts_it_from_the_index():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"ha")
    pool.free_blocks([a])
    [reused] = pool.get_new_blocks(1)
    assert reused is a
    assert a.block_hash is None
    assert pool.get_cached_block(b"ha") is None
    assert pool.num_cached_evictable == 0


def test_cache_full_block_keeps_the_first_block_for_a_hash():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, b"same")
    assert not pool.cache_full_block(b, b"same")
    assert b.block_hash is None
    assert pool.get_cached_block(b"same") is a
    with pytest.raises(ValueError):
        pool.cache_full_block(a, b"other")  # already hashed
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.cache_full_block(b, b"other")  # not in use


def test_freeing_in_reverse_makes_the_last_block_evicted_first():
    pool = BlockPool(3)
    table = pool.get_new_blocks(3)
    for i, block in enumerate(table):
        pool.cache_full_block(block, bytes([i]))
    pool.free_blocks(reversed(table))
    assert ids(pool.free_block_queue) == [2, 1, 0]
    [evicted] = pool.get_new_blocks(1)
    assert evicted is table[-1]
    assert pool.get_cached_block(bytes([2])) is None
    assert pool.get_cached_block(bytes([0])) is table[0]
    assert pool.get_cached_block(bytes([1])) is table[1]


# --------------------------------------------------------------------------- random sequences


NUM_BLOCKS = 12
HASHES = [bytes([i]) for i in range(6)]  # few, so hashes collide and get evicted and reused


class BlockPoolMachine(RuleBasedStateMachine):
    """Owners are block tables: fresh ones from get_new_blocks, shared ones from touching cached blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.tables: dict[int, list[KVBlock]] = {}
        self.next_owner = 0

    def _new_owner(self, blocks: list[KVBlock]) -> None:
        self.tables[self.next_owner] = blocks
        self.next_owner += 1

    @rule(n=st.integers(0, NUM_BLOCKS + 2))
    def allocate(self, n: int) -> None:
        free_before = self.pool.num_free_blocks
        if n > free_before:
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)
            assert self.pool.num_free_blocks == free_before
            return
        self._new_owner(self.pool.get_new_blocks(n))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(1, 3))
    def append(self, data, n: int) -> None:
        owner = data.draw(st.sampled_from(sorted(self.tables)))
        if n <= self.pool.num_free_blocks:
            self.tables[owner].extend(self.pool.get_new_blocks(n))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), block_hash=st.sampled_from(HASHES))
    def cache(self, data, block_hash: bytes) -> None:
        owner = data.draw(st.sampled_from(sorted(self.tables)))
        unhashed = [block for block in self.tables[owner] if block.block_hash is None]
        if unhashed:
            block = data.draw(st.sampled_from(unhashed))
            cached = self.pool.cache_full_block(block, block_hash)
            assert cached == (self.pool.get_cached_block(block_hash) is block)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data) -> None:
        owner = data.draw(st.sampled_from(sorted(self.tables)))
        self.pool.free_blocks(reversed(self.tables.pop(owner)))

    @rule(hashes=st.lists(st.sampled_from(HASHES), min_size=1, max_size=3, unique=True))
    def touch_cached(self, hashes: list[bytes]) -> None:
        hits = [block for h in hashes if (block := self.pool.get_cached_block(h)) is not None]
        self.pool.touch(hits)
        self._new_owner(hits)

    @invariant()
    def states_partition_the_pool(self) -> None:
        blocks = self.pool.blocks
        in_use = sum(block.ref_cnt > 0 for block in blocks)
        cached_evictable = sum(block.ref_cnt == 0 and block.block_hash is not None for block in blocks)
        free_uncached = sum(block.ref_cnt == 0 and block.block_hash is None for block in blocks)
        assert free_uncached + in_use + cached_evictable == NUM_BLOCKS
        assert self.pool.num_in_use == in_use
        assert self.pool.num_cached_evictable == cached_evictable
        assert self.pool.num_free_blocks == free_uncached + cached_evictable

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self) -> None:
        queued = ids(self.pool.free_block_queue)
        assert len(queued) == len(set(queued)) == len(self.pool.free_block_queue)
        assert set(queued) == {block.block_id for block in self.pool.blocks if block.ref_cnt == 0}

    @invariant()
    def ref_cnt_counts_owners(self) -> None:
        owners = [0] * NUM_BLOCKS
        for table in self.tables.values():
            assert len(set(ids(table))) == len(table)  # no owner holds a block twice
            for block in table:
                owners[block.block_id] += 1
        assert [block.ref_cnt for block in self.pool.blocks] == owners

    @invariant()
    def index_matches_block_hashes(self) -> None:
        assert all(block.block_hash == h for h, block in self.pool.cached_blocks.items())
        hashed = {block.block_id for block in self.pool.blocks if block.block_hash is not None}
        assert hashed == {block.block_id for block in self.pool.cached_blocks.values()}


BlockPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_pool_random_sequences = BlockPoolMachine.TestCase
