"""Names of offloaded KV blocks in Redis, shared by the block manager (which looks them up) and the
executor (which reads and writes them)."""
from __future__ import annotations

REDIS_KEY_PREFIX = "pagedserve:kv:v1:"


def redis_key(block_hash: bytes) -> str:
    """One key per block; the hash already names the model, dtype and block size (its chain's root)."""
    return REDIS_KEY_PREFIX + block_hash.hex()
