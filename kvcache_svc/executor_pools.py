"""Several executors behind one block manager: one pool and prefix index (a ``KVCacheManager``) per
executor, the registrations that keep them, and the routing that picks an executor for each new request.

An executor registers at start (its address, which names it, its model fingerprint, its pool and its epoch)
and registers again by heartbeat; one whose heartbeats stop for ``heartbeat_ttl_s`` is dropped, with its pool.
A registration under a new epoch (the executor restarted) starts a new pool: the KV behind the old one died.
Every executor must serve the same model with the same block size, since prefix hashes and the scheduler's
plans assume one: another fingerprint is refused.

Still one call per engine step: the running requests say which executor they live on, and ``step`` routes
each waiting one (``kv``: the executor whose pool, then offload tier, holds the longest cached prefix of its
tokens; ties and misses to the least loaded, by KV usage and then tokens routed to it this step;
``round_robin``: in turn), then serves each pool's part with its own manager and answers per executor. A
running request whose executor is gone is reported preempted, so the scheduler recomputes it elsewhere.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.step import BlockRequest, BlockStepRequest, BlockStepResult

ROUTING_POLICIES = ("kv", "round_robin")


class ExecutorRefused(ValueError):
    """A registration that does not fit the executors already registered."""


class NoExecutor(RuntimeError):
    """No executor is registered: nothing can be planned yet."""


@dataclass(frozen=True, slots=True)
class ExecutorRegistration:
    address: str  # where it serves: names it
    epoch: str  # this instance: changes with every start
    model_fingerprint: str  # the model's identity (weights, dtype): the root of every prefix hash
    num_blocks: int
    block_size: int
    pool: object = field(default=None, compare=False)  # everything else it reports, for building its manager


@dataclass(slots=True)
class ExecutorPool:
    registration: ExecutorRegistration
    manager: KVCacheManager
    last_heartbeat: float
    expires: bool = True  # False for an executor given at start-up, which is followed through its epoch instead


class ExecutorPools:
    def __init__(self, build_manager: Callable[[ExecutorRegistration], KVCacheManager], routing: str = "kv",
                 heartbeat_ttl_s: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}")
        self.build_manager = build_manager
        self.routing = routing
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.clock = clock
        self.pools: dict[str, ExecutorPool] = {}
        # Until a heartbeat period has passed since start-up, an executor a running request names may simply not
        # have registered again yet (this service restarted): the step waits for it rather than lose its requests.
        self.started_at = clock()
        # The part of the last step each pool served, as it served it (what a journal of its state records).
        self.served: dict[str, BlockStepRequest] = {}
        self._next_in_turn = 0  # round_robin: the index of the executor the next request goes to

    # ------------------------------------------------------------------ membership

    def register(self, registration: ExecutorRegistration, expires: bool = True,
                 manager: KVCacheManager | None = None) -> bool:
        """Adds the executor, or renews its registration (a heartbeat); True when its pool is new (a first
        registration, or a new epoch). manager: its pool as restored from a saved state (else a new one is
        built). Raises ExecutorRefused when its model or block size differs from the others'."""
        for other in self.pools.values():
            theirs = other.registration
            if theirs.address == registration.address:
                continue
            if (theirs.model_fingerprint, theirs.block_size) != (registration.model_fingerprint,
                                                                 registration.block_size):
                raise ExecutorRefused(
                    f"executor {registration.address} serves model {registration.model_fingerprint!r} with "
                    f"blocks of {registration.block_size} tokens, but executor {theirs.address} serves "
                    f"{theirs.model_fingerprint!r} with blocks of {theirs.block_size}: every executor must "
                    f"serve the same model and block size")
        if not self.is_new(registration):
            self.pools[registration.address].last_heartbeat = self.clock()
            return False
        self.pools[registration.address] = ExecutorPool(registration, manager or self.build_manager(registration),
                                                       self.clock(), expires)
        return True

    def is_new(self, registration: ExecutorRegistration) -> bool:
        """Whether registering it would start a pool (a first registration, or a new epoch)."""
        known = self.pools.get(registration.address)
        return known is None or known.registration.epoch != registration.epoch

    def drop(self, address: str, epoch: str | None = None) -> bool:
        """Forgets the executor and its pool (its requests are then reported preempted), if registered (under
        that epoch, when given); whether it was."""
        pool = self.pools.get(address)
        if pool is None or epoch not in (None, pool.registration.epoch):
            return False
        del self.pools[address]
        return True

    def expire(self) -> list[str]:
        """Drops the executors whose heartbeats stopped; their addresses."""
        now = self.clock()
        gone = [address for address, pool in self.pools.items()
                if pool.expires and now - pool.last_heartbeat > self.heartbeat_ttl_s]
        for address in gone:
            self.drop(address)
        return gone

    def executors(self) -> list[ExecutorRegistration]:
        return [pool.registration for pool in self.pools.values()]

    # ------------------------------------------------------------------ one step

    def step(self, step_request: BlockStepRequest) -> dict[str, BlockStepResult]:
        """Serves one step over every pool: per executor address, the answer for the requests on it (and an
        empty answer for a pool with nothing this step). A running request with no executor named lives on
        the only one; raises ValueError when there are several, NoExecutor when there is none."""
        if not self.pools:
            raise NoExecutor("no executor is registered with the KV-cache service yet")
        parts = {address: ([], []) for address in self.pools}
        preempted: list[str] = []
        for request in step_request.running:
            address = request.executor_id or self._only_executor("a running request")
            if address in parts:
                parts[address][0].append(request)
            elif self.clock() - self.started_at < self.heartbeat_ttl_s:
                raise NoExecutor(f"executor {address} has not registered again since this service started")
            else:  # its executor is gone, and its KV with it
                preempted.append(request.request_id)
        for request, address in zip(step_request.waiting, self.route(step_request.waiting)):
            parts[address][1].append(request)
        results, self.served = {}, {}
        for address, (running, waiting) in parts.items():
            pool = self.pools[address]
            # A scheduler driving one executor names the instance it plans for; else it is the registered one.
            epoch = (step_request.executor_epoch if len(self.pools) == 1 else "") or pool.registration.epoch
            part = self.served[address] = replace(step_request, executor_epoch=epoch, running=running,
                                                  waiting=waiting)
            results[address] = pool.manager.step(part)
            results[address].executor_epoch = epoch
        if preempted:
            first = next(iter(results.values()))
            first.preempted_request_ids.extend(preempted)
        return results

    def _only_executor(self, what: str) -> str:
        if len(self.pools) != 1:
            raise ValueError(f"{what} must name its executor when {len(self.pools)} are registered")
        return next(iter(self.pools))

    def route(self, waiting: list[BlockRequest]) -> list[str]:
        """The executor each waiting request goes to, in order."""
        addresses = list(self.pools)
        if len(addresses) == 1:
            return addresses * len(waiting)
        routed_blocks = dict.fromkeys(addresses, 0)  # taken by the requests routed so far this step
        routed_tokens = dict.fromkeys(addresses, 0)
        chosen = []
        for request in waiting:
            if self.routing == "round_robin":
                address = addresses[self._next_in_turn % len(addresses)]
                self._next_in_turn += 1
            else:
                address = self._kv_route(request, addresses, routed_blocks, routed_tokens)
            manager = self.pools[address].manager
            routed_blocks[address] += -(-request.num_tokens // manager.block_size)
            routed_tokens[address] += request.num_tokens
            chosen.append(address)
        return chosen

    def _kv_route(self, request: BlockRequest, addresses: list[str], routed_blocks: dict[str, int],
                  routed_tokens: dict[str, int]) -> str:
        def load(address: str) -> tuple[float, int]:
            manager = self.pools[address].manager
            return (manager.block_pool.num_in_use + routed_blocks[address]) / manager.num_blocks, \
                routed_tokens[address]

        cached = {address: self.pools[address].manager.cached_prefix_tokens(
            request.request_id, request.prompt_token_ids or [], request.cache_salt) for address in addresses}
        longest = max(cached.values())
        return min((address for address in addresses if cached[address] == longest), key=load)

    # ------------------------------------------------------------------ counters

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per executor address, its manager's counters."""
        return {address: pool.manager.stats() for address, pool in self.pools.items()}
