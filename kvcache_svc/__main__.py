"""python -m kvcache_svc --port 50053 [--executor 127.0.0.1:50054]

Each pool is an executor's: its KV tensors hold num_blocks blocks of block_size tokens. With --executor, the
service serves that one executor (and follows its restarts through the scheduler); without, executors
register themselves (executor_svc --kvcache), one pool each, and stay registered by heartbeat.
"""
from __future__ import annotations

import logging

from kvcache_svc.build import build_block_manager
from kvcache_svc.durable_state import DurableState, RegistrationStore
from kvcache_svc.executor_pools import ExecutorPools
from kvcache_svc.server import KVCacheServicer, registration_from_proto
from pagedserve.config import CacheConfig, ServingConfig, parse
from pagedserve.service import Security, Service, channel, configure_logging, pin_to_cpus, set_nice
from pagedserve.v1 import executor_pb2, executor_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc

logger = logging.getLogger("kvcache_svc")

SECTIONS = {
    ServingConfig: ("host", "port", "log_level", "cpus", "nice", "executor", "startup_timeout", "tls_cert", "tls_key",
                    "tls_ca", "internal_token_file", "heartbeat_ttl"),
    CacheConfig: ("enable_prefix_caching", "offload_all", "redis_url", "redis_namespace", "preemption_mode",
                  "routing"),
}


def parse_args(argv: list[str] | None = None) -> dict:
    return parse("python -m kvcache_svc", __doc__, SECTIONS, argv)


def main(argv: list[str] | None = None) -> None:
    configs = parse_args(argv)
    serving = configs[ServingConfig]
    configure_logging(serving.log_level)
    pin_to_cpus(serving.cpus)
    set_nice(serving.nice)
    security = Security.from_config(serving)
    cache = configs[CacheConfig]
    redis_client = None
    if cache.redis_url:
        import redis

        redis_client = redis.Redis.from_url(cache.redis_url, socket_timeout=2.0)
    # With Redis, each pool's state is journaled there and a restart resumes from it; registered executors
    # are kept there too, so that their pools are restored before they next beat.
    journals: dict[str, DurableState] = {}

    def journal(address: str) -> DurableState:
        if address not in journals:
            journals[address] = DurableState(redis_client, cache.redis_namespace,
                                             pool="" if serving.executor else address)
        return journals[address]

    pools = ExecutorPools(lambda registration: build_block_manager(cache, registration.pool), cache.routing,
                          serving.heartbeat_ttl)
    registrations = None
    if serving.executor:
        with channel(serving.executor, security) as ch:
            info = executor_pb2_grpc.ExecutorStub(ch).GetInfo(
                executor_pb2.ExecutorInfoRequest(), wait_for_ready=True, timeout=serving.startup_timeout
            )
        saved = [kvcache_pb2.ExecutorRegistration(address=serving.executor, info=info).SerializeToString()]
        logger.info("block pool: %d blocks of %d tokens", info.num_blocks, info.block_size)
    else:
        if redis_client is not None:
            registrations = RegistrationStore(redis_client, cache.redis_namespace, serving.heartbeat_ttl)
        saved = registrations.load() if registrations is not None else []
    servicer = KVCacheServicer(pools, journal if redis_client is not None else None, registrations,
                               accepts_registrations=not serving.executor)
    for data in saved:
        servicer.register(registration_from_proto(kvcache_pb2.ExecutorRegistration.FromString(data)),
                          expires=not serving.executor)
    service = Service("kvcache_svc", serving.host, serving.listen_port("kvcache_svc"), security=security,
                      dependencies={"executor_svc": serving.executor} if serving.executor else {})
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(servicer, service.server)
    service.serve_until_signalled()


if __name__ == "__main__":
    main()
