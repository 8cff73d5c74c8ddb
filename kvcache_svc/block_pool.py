"""The pool of fixed-size KV-cache blocks: who holds each block, which are free, which are cached.

A block is in one of three states:
  free             ref_cnt == 0, no hash, in the free queue;
  in use           ref_cnt > 0, not in the free queue;
  cached-evictable ref_cnt == 0, has a hash, in the free queue: a prefix hit can take it back
                   (``touch``), or ``get_new_blocks`` evicts it when it reaches the queue head.
The free queue is LRU: blocks are taken from the head and returned to the tail, so the cached blocks
freed longest ago are evicted first.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # number of block tables that hold this block
        self.block_hash: bytes | None = None  # set only while the block is full and in the prefix index
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash!r})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves, so a cache hit can unlink a block from
    the middle in O(1) (a deque would need a linear search)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        # Sentinels remove the empty-list and end-of-list special cases from every operation.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("popleft from an empty FreeBlockQueue")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > self._len:
            raise IndexError(f"popleft_n({n}) from a FreeBlockQueue of {self._len}")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def append_n(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            self.append(block)


class BlockPool:
    """Owns every block (ids 0..num_blocks-1, all usable), the free queue and the prefix index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVBlock] = {}
        # Kept as a counter so stats stay O(1) however large the prefix index grows.
        self._num_cached_evictable = 0
        self.num_evictions = 0  # cached blocks reused for other tokens
        # (block id, hash it held) of evictions not yet collected by the manager, for the offload tier.
        self.evicted: list[tuple[int, bytes]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks get_new_blocks can hand out: free ones plus cached-evictable ones."""
        return len(self.free_block_queue)

    @property
    def num_cached_evictable(self) -> int:
        return self._num_cached_evictable

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_in_use / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Takes n blocks from the LRU end of the free queue, evicting any that are still cached."""
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: {self.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                self.evicted.append((block.block_id, block.block_hash))
                block.block_hash = None
                self._num_cached_evictable -= 1
                self.num_evictions += 1
            block.ref_cnt = 1
        return blocks

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference to each block; those no longer held join the free-queue tail in the order
        given. Callers pass a request's blocks in reverse, so its last block, the one least likely to be
        shared as a prefix, is evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                if block.block_hash is not None:
                    self._num_cached_evictable += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes one more reference to each block (prefix-cache hits); an unreferenced block leaves the
        free queue so it can no longer be evicted."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached_evictable -= 1
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Indexes a full, in-use block under its hash. Returns False when another block already holds
        that hash: the first copy stays the indexed one, and this block is freed as an ordinary block."""
        if block.ref_cnt == 0 or block.block_hash is not None:
            raise ValueError(f"only an in-use, unhashed block can be cached, got {block}")
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def forget_cached_blocks(self) -> None:
        """Empties the prefix index (its KV is gone): cached blocks become plain ones where they are."""
        for block in self.cached_blocks.values():
            if block.ref_cnt == 0:
                self._num_cached_evictable -= 1
            block.block_hash = None
        self.cached_blocks.clear()
        self.evicted.clear()

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)
