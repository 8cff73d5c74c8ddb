"""The KV-cache service: the block manager behind one batched call per engine step."""
from __future__ import annotations

import threading

import grpc

from kvcache_svc.durable_state import DurableState
from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.convert import block_step_request_from_proto, block_step_result_to_proto
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, manager: KVCacheManager, durable: DurableState | None = None) -> None:
        self.manager = manager
        self.durable = durable
        self.lock = threading.Lock()  # one scheduler drives the pool; stats may be read meanwhile
        self.num_step_calls = 0

    def Step(self, request, context):
        try:
            step = block_step_request_from_proto(request)
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        with self.lock:
            self.num_step_calls += 1
            result = self.manager.step(step)
            if self.durable is not None:  # journaled before the answer leaves
                self.durable.record(self.manager, request.SerializeToString())
        return block_step_result_to_proto(result)

    def GetStats(self, request, context):
        with self.lock:
            stats = self.manager.stats()
            calls = self.num_step_calls
        return kvcache_pb2.KVCacheStats(
            num_blocks=stats["num_blocks"], block_size=self.manager.block_size,
            num_free_blocks=stats["num_free_blocks"], num_in_use=stats["num_in_use"],
            num_cached_evictable=stats["num_cached_evictable"], num_requests=stats["num_requests"],
            usage=stats["usage"], num_step_calls=calls, prefix_cache_queries=stats["prefix_cache_queries"],
            prefix_cache_hits=stats["prefix_cache_hits"], evictions=stats["evictions"],
            tier_hits=stats["tier_hits"], blocks_saved=stats["blocks_saved"], tier_errors=stats["tier_errors"],
            bytes_moved=stats["bytes_moved"], num_preemptions=stats["num_preemptions"], num_swaps=stats["num_swaps"],
            blocks_swapped_out=stats["blocks_swapped_out"], blocks_swapped_in=stats["blocks_swapped_in"],
            swap_blocks_in_use=stats["swap_blocks_in_use"],
        )
