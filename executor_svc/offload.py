"""Host memory for K/V blocks: the offload tier, where blocks go when the pool evicts them and come back from
on a prefix hit, and the swap space, which holds the blocks of requests preempted by swap until they resume.

A block travels as one value: its K and V for every layer, ``[layers, 2, kv_heads, block_size, head_dim]``
in the cache's dtype, as raw bytes, named by its prefix hash. Host memory keeps them in this process (LRU,
bounded in bytes); Redis keeps them under ``pagedserve:kv:v1:<block hash>`` (binary values, pipelined
batches, an optional TTL, and Redis's own maxmemory eviction). A tier that fails is switched off with a
warning and counted; what it would have held is recomputed.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from pagedserve.kv_keys import redis_key

logger = logging.getLogger(__name__)


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"offload_host_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self.num_bytes = 0
        self.errors = 0

    def save(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for block_hash, value in items:
            old = self.blocks.pop(block_hash, None)
            if old is not None:
                self.num_bytes -= len(old)
            self.blocks[block_hash] = value
            self.num_bytes += len(value)
        while self.num_bytes > self.capacity_bytes and self.blocks:
            _, dropped = self.blocks.popitem(last=False)
            self.num_bytes -= len(dropped)

    def load(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        values = []
        for block_hash in block_hashes:
            value = self.blocks.get(block_hash)
            if value is not None:
                self.blocks.move_to_end(block_hash)
            values.append(value)
        return values


class SwapSpace:
    """The blocks of requests preempted by swap. The block manager decides what enters and leaves, and keeps
    it within capacity_bytes (it counts in blocks of the size the executor reports); nothing here evicts, so
    a copy stays exactly until the block manager releases it (its request resumed, ended, or a step that
    should have copied it never ran)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"swap_host_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.blocks: dict[bytes, bytes] = {}
        self.num_bytes = 0

    def save(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for block_hash, value in items:
            self.free([block_hash])
            self.blocks[block_hash] = value
            self.num_bytes += len(value)

    def load(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        return [self.blocks.get(block_hash) for block_hash in block_hashes]

    def free(self, block_hashes: Sequence[bytes]) -> None:
        for block_hash in block_hashes:
            value = self.blocks.pop(block_hash, None)
            if value is not None:
                self.num_bytes -= len(value)


class RedisTier:
    name = "redis"

    def __init__(self, url: str, ttl_seconds: int | None = None, timeout_seconds: float = 2.0,
                 namespace: str = "pagedserve") -> None:
        import redis

        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds)
        self.ttl_seconds = ttl_seconds
        self.namespace = namespace
        self.errors = 0
        self.disabled = False

    def _fail(self, action: str, error: Exception) -> None:
        self.errors += 1
        if not self.disabled:
            logger.warning("offload tier disabled: Redis %s failed (%s); blocks will be recomputed", action, error)
        self.disabled = True

    def save(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if self.disabled or not items:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash, value in items:
                pipe.set(redis_key(self.namespace, block_hash), value, ex=self.ttl_seconds)
            pipe.execute()
        except Exception as error:  # any Redis failure: go on without the tier
            self._fail("write", error)

    def load(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        if self.disabled or not block_hashes:
            return [None] * len(block_hashes)
        try:
            return list(self.client.mget([redis_key(self.namespace, h) for h in block_hashes]))
        except Exception as error:  # any Redis failure: go on without the tier
            self._fail("read", error)
            return [None] * len(block_hashes)


def make_tier(kind: str, *, host_bytes: int = 1 << 30, redis_url: str | None = None,
              redis_ttl: int | None = None, redis_namespace: str = "pagedserve") -> HostTier | RedisTier | None:
    if kind == "none":
        return None
    if kind == "host":
        return HostTier(host_bytes)
    if kind == "redis":
        if not redis_url:
            raise ValueError("offload 'redis' needs redis_url")
        return RedisTier(redis_url, redis_ttl, namespace=redis_namespace)
    raise ValueError(f"offload must be 'none', 'host' or 'redis', got {kind!r}")
