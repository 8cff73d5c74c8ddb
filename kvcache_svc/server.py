"""The KV-cache service: the block manager behind one batched call per engine step, one pool per executor."""
from __future__ import annotations

import logging
import threading

import grpc

from collections.abc import Callable

from kvcache_svc.durable_state import DurableState, RegistrationStore
from kvcache_svc.executor_pools import ExecutorPools, ExecutorRefused, ExecutorRegistration, NoExecutor
from pagedserve.convert import block_step_request_from_proto, block_step_request_to_proto, block_step_results_to_proto
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc

logger = logging.getLogger("kvcache_svc")

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
    def __init__(self, pools: ExecutorPools, journal: Callable[[str], DurableState] | None = None,
                 registrations: RegistrationStore | None = None, accepts_registrations: bool = True) -> None:
        """journal: each pool's saved state, by executor address (with Redis); registrations: where they are
        kept too (with Redis); accepts_registrations: False when following the one executor given at start-up."""
        self.pools = pools
        self.journal = journal
        self.registrations = registrations
        self.accepts_registrations = accepts_registrations
        self.lock = threading.Lock()  # one scheduler drives the pools; registrations and stats come meanwhile
        self.num_step_calls = 0

    def Step(self, request, context):
        try:
            step = block_step_request_from_proto(request)
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        with self.lock:
            self._expire()
            self.num_step_calls += 1
            try:
                results = self.pools.step(step)
            except NoExecutor as error:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
            except ValueError as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            if self.journal is not None:  # each pool's part, journaled before the answer leaves
                for address, part in self.pools.served.items():
                    self.journal(address).record(self.pools.pools[address].manager,
                                                 block_step_request_to_proto(part).SerializeToString())
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
            self._expire()
            try:
                new_pool = self.register(registration)
            except ExecutorRefused as error:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
            if self.registrations is not None:
                self.registrations.save(registration.address, request.SerializeToString())
        return kvcache_pb2.RegistrationReply(new_pool=new_pool, heartbeat_ttl_s=self.pools.heartbeat_ttl_s)

    def ListExecutors(self, request, context):
        with self.lock:
            self._expire()
            return kvcache_pb2.ExecutorList(executors=[
                kvcache_pb2.RegisteredExecutor(address=r.address, epoch=r.epoch) for r in self.pools.executors()])

    def register(self, registration: ExecutorRegistration, expires: bool = True) -> bool:
        """Registers the executor (see ExecutorPools.register); a new pool starts from the state saved for that
        executor instance, if any (this service restarted under it), else empty."""
        manager = None
        if self.journal is not None and self.pools.is_new(registration):
            journal = self.journal(registration.address)
            manager = self.pools.build_manager(registration)
            replayed = journal.restore(manager, lambda data: block_step_request_from_proto(
                kvcache_pb2.BlockStepRequest.FromString(data)))
            if manager.executor_epoch == registration.epoch:
                logger.warning("restored the pool of executor %s from Redis (%d requests, %d journaled steps "
                               "replayed)", registration.address, manager.num_requests, replayed)
            else:  # saved for another instance of it, whose KV is gone
                manager = None
                journal.discard()
        return self.pools.register(registration, expires, manager)

    def DropExecutor(self, request, context):
        with self.lock:
            dropped = self.pools.drop(request.address, request.epoch)
            if dropped:
                logger.warning("executor %s dropped with its pool: %s", request.address, request.reason)
                self._forget(request.address)
        return kvcache_pb2.DropExecutorReply(dropped=dropped)

    def _expire(self) -> None:
        for address in self.pools.expire():
            logger.warning("executor %s dropped with its pool: no heartbeat for %g s", address,
                           self.pools.heartbeat_ttl_s)
            self._forget(address)

    def _forget(self, address: str) -> None:
        """What is kept of a dropped executor's pool: the KV it described is gone."""
        if self.registrations is not None:
            self.registrations.drop(address)
        if self.journal is not None:
            self.journal(address).discard()

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
