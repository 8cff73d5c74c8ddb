"""Names of what pagedserve keeps in Redis: offloaded KV blocks, shared by the block manager (which looks
them up) and the executor (which reads and writes them), and the block manager's own state."""
from __future__ import annotations


def redis_key(namespace: str, block_hash: bytes) -> str:
    """One key per block under the deployment's namespace (CacheConfig.redis_namespace), so deployments that
    share a Redis never read each other's blocks; the hash already names the model, dtype and block size."""
    return f"{namespace}:kv:v1:{block_hash.hex()}"
