"""The block manager built from the configuration and the executor's pool: by `python -m kvcache_svc` and by
the offline LLM."""
from __future__ import annotations

from kvcache_svc.kv_cache_manager import KVCacheManager
from kvcache_svc.offload_index import make_tier_index
from pagedserve.config import CacheConfig


def build_block_manager(cache: CacheConfig, pool) -> KVCacheManager:
    """pool: what the executor reports (its ExecutorInfo): the KV tensors' blocks, its offload tier, its swap
    space and what recomputing and copying cost it."""
    return KVCacheManager(
        pool.num_blocks, pool.block_size, enable_prefix_caching=cache.enable_prefix_caching,
        model_id=pool.model_id,
        tier=make_tier_index(pool.offload, pool.offload_capacity_blocks, pool.offload_redis_url,
                             cache.redis_namespace),
        write_through=cache.offload_all, block_bytes=pool.block_bytes,
        preemption_mode=cache.preemption_mode, swap_capacity_blocks=pool.swap_capacity_blocks,
        prefill_tokens_per_s=pool.prefill_tokens_per_s, copy_bytes_per_s=pool.copy_bytes_per_s,
    )
