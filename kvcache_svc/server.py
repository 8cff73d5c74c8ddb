"""The KV-cache service: the block manager behind one batched call per engine step, one pool per executor."""
from __future__ import annotations

import threading

import grpc

from kvcache_svc.durable_state import DurableState
from kvcache_svc.executor_pools import ExecutorPools, ExecutorRefused, ExecutorRegistration, NoExecutor
from pagedserve.convert import block_step_request_from_proto, block_step_results_to_proto
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc

# The counters of KVCacheStats that add up over executors (usage is worked out from the sums).
_SUMMED = ("num_blocks", "num_free_blocks", "num_in_use", "num_cached_evictable", "num_requests",
           "prefix_cache_queries", "prefix_cache_hits", "evictions", "tier_hits", "blocks_saved", "tier_errors",
           "bytes_moved", "num_preemptions", "num_swaps", "blocks_swapped_out", "blocks_swapped_in",
           "swap_blocks_in_use")


def registration_from_proto(message: kvcache_pb2.ExecutorRegistration) -> ExecutorRegistration:
    info = message.info
    if not message.address or not info.epoch or info.num_blocks <= 0 or info.block_size <= 0:
        raise ValueError("a registration needs the executor's address, epoch, num_blocks and block_size")
    return ExecutorRegistration(message.address, info.epoch, info.model_id, info.num_blocks, info.block_size,
                                pool=info)


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, pools: ExecutorPools, durable: DurableState | None = None,
                 accepts_registrations: bool = True) -> None:
        """durable: the journal of the one executor given at start-up (accepts_registrations is then False)."""
        self.pools = pools
        self.durable = durable
        self.accepts_registrations = accepts_registrations
        self.lock = threading.Lock()  # one scheduler drives the pools; registrations and stats come meanwhile
        self.num_step_calls = 0

    def Step(self, request, context):
        try:
            step = block_step_request_from_proto(request)
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        with self.lock:
            self.pools.expire()
            self.num_step_calls += 1
            try:
                results = self.pools.step(step)
            except NoExecutor as error:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
            except ValueError as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            if self.durable is not None:  # journaled before the answer leaves
                [pool] = self.pools.pools.values()
                self.durable.record(pool.manager, request.SerializeToString())
        return block_step_results_to_proto(results)

    def RegisterExecutor(self, request, context):
        if not self.accepts_registrations:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this KV-cache service follows the one executor given by --executor; start it without "
                          "--executor to let executors register")
        try:
            registration = registration_from_proto(request)
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        with self.lock:
            self.pools.expire()
            try:
                new_pool = self.pools.register(registration)
            except ExecutorRefused as error:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return kvcache_pb2.RegistrationReply(new_pool=new_pool, heartbeat_ttl_s=self.pools.heartbeat_ttl_s)

    def ListExecutors(self, request, context):
        with self.lock:
            self.pools.expire()
            return kvcache_pb2.ExecutorList(executors=[
                kvcache_pb2.RegisteredExecutor(address=r.address, epoch=r.epoch) for r in self.pools.executors()])

    def GetStats(self, request, context):
        with self.lock:
            per_executor = self.pools.stats()
            calls = self.num_step_calls
        block_size = next(iter(self.pools.pools.values())).registration.block_size if self.pools.pools else 0
        out = kvcache_pb2.KVCacheStats(block_size=block_size, num_step_calls=calls)
        for address, stats in per_executor.items():
            part = out.executors[address]
            part.block_size = block_size
            part.usage = stats["usage"]
            for name in _SUMMED:
                setattr(part, name, stats[name])
                setattr(out, name, getattr(out, name) + stats[name])
        out.usage = out.num_in_use / out.num_blocks if out.num_blocks else 0.0
        return out
