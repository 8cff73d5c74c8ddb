"""python -m kvcache_svc --port 50053 [--executor 127.0.0.1:50054]

Each pool is an executor's: its KV tensors hold num_blocks blocks of block_size tokens. With --executor, the
service serves that one executor (and follows its restarts through the scheduler); without, executors
register themselves (executor_svc --kvcache), one pool each, and stay registered by heartbeat.
"""
from __future__ import annotations

import logging

from kvcache_svc.build import build_block_manager
from kvcache_svc.durable_state import DurableState
from kvcache_svc.executor_pools import ExecutorPools
from kvcache_svc.server import KVCacheServicer, registration_from_proto
from pagedserve.convert import block_step_request_from_proto
from pagedserve.config import CacheConfig, ServingConfig, parse
from pagedserve.service import Security, Service, channel, configure_logging
from pagedserve.v1 import executor_pb2, executor_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc

logger = logging.getLogger("kvcache_svc")

SECTIONS = {
    ServingConfig: ("host", "port", "log_level", "executor", "startup_timeout", "tls_cert", "tls_key", "tls_ca",
                    "internal_token_file", "heartbeat_ttl"),
    CacheConfig: ("enable_prefix_caching", "offload_all", "redis_url", "redis_namespace", "preemption_mode",
                  "routing"),
}


def parse_args(argv: list[str] | None = None) -> dict:
    return parse("python -m kvcache_svc", __doc__, SECTIONS, argv)


def main(argv: list[str] | None = None) -> None:
    configs = parse_args(argv)
    serving = configs[ServingConfig]
    configure_logging(serving.log_level)
    security = Security.from_config(serving)
    cache = configs[CacheConfig]
    pools = ExecutorPools(lambda registration: build_block_manager(cache, registration.pool), cache.routing,
                          serving.heartbeat_ttl)
    durable = None
    if serving.executor:
        with channel(serving.executor, security) as ch:
            info = executor_pb2_grpc.ExecutorStub(ch).GetInfo(
                executor_pb2.ExecutorInfoRequest(), wait_for_ready=True, timeout=serving.startup_timeout
            )
        pools.register(registration_from_proto(kvcache_pb2.ExecutorRegistration(address=serving.executor, info=info)),
                       expires=False)
        [pool] = pools.pools.values()
        durable = durable_state(cache, pool.manager)
        logger.info("block pool: %d blocks of %d tokens", info.num_blocks, info.block_size)
    service = Service("kvcache_svc", serving.host, serving.listen_port("kvcache_svc"), security=security,
                      dependencies={"executor_svc": serving.executor} if serving.executor else {})
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(
        KVCacheServicer(pools, durable, accepts_registrations=not serving.executor), service.server)
    service.serve_until_signalled()


def durable_state(cache: CacheConfig, manager) -> DurableState | None:
    """With Redis, the pool's state is kept there and a restart resumes from it."""
    if not cache.redis_url:
        return None
    import redis

    durable = DurableState(redis.Redis.from_url(cache.redis_url, socket_timeout=2.0), cache.redis_namespace)
    replayed = durable.restore(manager, lambda data: block_step_request_from_proto(
        kvcache_pb2.BlockStepRequest.FromString(data)))
    if replayed >= 0:
        logger.warning("restored the block manager's state from Redis (%d requests, %d journaled steps replayed)",
                       manager.num_requests, replayed)
    return durable


if __name__ == "__main__":
    main()
