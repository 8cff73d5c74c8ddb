"""What the block manager knows of the offload tier: which block hashes it can expect to find there.

The bytes themselves move between the executor and the tier; this index only decides what to ask for.
It may be stale (the host tier drops its oldest blocks, Redis evicts under maxmemory or expires keys): a
block the executor then cannot load is recomputed, so a stale answer costs time, never correctness.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from pagedserve.kv_keys import redis_key

logger = logging.getLogger(__name__)


class LocalTierIndex:
    """The hashes this manager has sent to the tier, most recent last, up to the tier's capacity."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"offload capacity must be at least one block, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.hashes: OrderedDict[bytes, None] = OrderedDict()

    def record(self, block_hashes: Sequence[bytes]) -> None:
        for block_hash in block_hashes:
            self.hashes[block_hash] = None
            self.hashes.move_to_end(block_hash)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)

    def executor_replaced(self) -> None:
        """The host tier lived in the old executor's memory: nothing of it is left."""
        self.hashes.clear()

    def leading_count(self, block_hashes: Sequence[bytes]) -> int:
        """How many of these hashes, from the first, the tier holds."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.hashes:
                break
            self.hashes.move_to_end(block_hash)
            count += 1
        return count

    def stats(self) -> dict[str, int]:
        return {"tier_index_blocks": len(self.hashes), "tier_errors": 0}


class RedisTierIndex(LocalTierIndex):
    """Asks Redis itself about hashes this process has not seen saved, so that blocks written before a
    restart, or by another executor, are found. A Redis that fails disables the lookups, with a warning."""

    def __init__(self, client, capacity_blocks: int, namespace: str = "pagedserve") -> None:
        super().__init__(capacity_blocks)
        self.client = client
        self.namespace = namespace
        self.errors = 0
        self.disabled = False

    def executor_replaced(self) -> None:
        """Redis outlives the executor: what it holds was computed from the same weights and stays valid."""

    def leading_count(self, block_hashes: Sequence[bytes]) -> int:
        local = super().leading_count(block_hashes)
        rest = list(block_hashes[local:])
        if not rest or self.disabled:
            return local
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash in rest:
                pipe.exists(redis_key(self.namespace, block_hash))
            present = pipe.execute()
        except Exception as error:  # any Redis failure: go on without the tier
            self.errors += 1
            self.disabled = True
            logger.warning("offload tier disabled: Redis lookup failed (%s); prefixes will be recomputed", error)
            return local
        found = 0
        for flag in present:
            if not flag:
                break
            found += 1
        self.record(rest[:found])
        return local + found

    def stats(self) -> dict[str, int]:
        return {"tier_index_blocks": len(self.hashes), "tier_errors": self.errors}


# How many blocks the index remembers for Redis, whose own maxmemory policy decides what stays.
REDIS_INDEX_BLOCKS = 1 << 20


def make_tier_index(kind: str, capacity_blocks: int = 0, redis_url: str = "",
                    redis_namespace: str = "pagedserve") -> LocalTierIndex | None:
    """The index mirroring an executor's tier: its host capacity in blocks, or the same Redis."""
    if kind == "host":
        return LocalTierIndex(capacity_blocks)
    if kind == "redis":
        import redis

        return RedisTierIndex(redis.Redis.from_url(redis_url, socket_timeout=2.0), REDIS_INDEX_BLOCKS, redis_namespace)
    if kind == "none":
        return None
    raise ValueError(f"offload must be 'none', 'host' or 'redis', got {kind!r}")
