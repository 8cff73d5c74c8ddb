"""Names of what pagedserve keeps in Redis: offloaded KV blocks, shared by the block manager (which looks
them up) and the executor (which reads and writes them), and the block manager's own state."""
from __future__ import annotations

KEY_NAMESPACE = "pagedserve"
REDIS_KEY_PREFIX = f"{KEY_NAMESPACE}:kv:v1:"


def redis_key(block_hash: bytes) -> str:
    """One key per block; the hash already names the model, dtype and block size (its chain's root)."""
    return REDIS_KEY_PREFIX + block_hash.hex()
