"""A service's health follows its dependencies': NOT_SERVING while one is down or not serving itself, and
SERVING again once it is back on the same address."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.service import Service, channel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def status(address: str):
    with channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
        except grpc.RpcError:
            return None


def becomes(address: str, wanted, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if status(address) == wanted:
            return True
        time.sleep(0.05)
    return False


def test_health_is_not_serving_while_a_dependency_is_down_and_serving_once_it_returns():
    executor = Service("executor", "127.0.0.1", 0)
    executor.start()
    kvcache = Service("kvcache", "127.0.0.1", 0, dependencies={"executor": executor.address})
    kvcache.start()
    scheduler = Service("scheduler", "127.0.0.1", 0,
                        dependencies={"kvcache": kvcache.address, "executor": executor.address})
    scheduler.start()
    try:
        assert status(kvcache.address) == SERVING and status(scheduler.address) == SERVING

        executor.server.stop(0).wait()  # gone, as after a SIGKILL
        assert becomes(kvcache.address, NOT_SERVING)
        assert becomes(scheduler.address, NOT_SERVING)

        executor = Service("executor", "127.0.0.1", executor.port)  # restarted on the same port
        executor.start()
        assert becomes(kvcache.address, SERVING)
        assert becomes(scheduler.address, SERVING)

        # Alive but not serving counts as down, and travels up the chain.
        executor.health.set("", NOT_SERVING)
        assert becomes(kvcache.address, NOT_SERVING)
        executor.health.set("", SERVING)
        assert becomes(kvcache.address, SERVING)
    finally:
        for service in (scheduler, kvcache, executor):
            service.stop(grace=0)


def test_a_service_whose_dependency_is_down_at_start_is_not_serving():
    service = Service("frontend", "127.0.0.1", 0, dependencies={"scheduler": "127.0.0.1:1"})
    service.start()
    try:
        assert status(service.address) == NOT_SERVING
    finally:
        service.stop(grace=0)
