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


def test_a_service_whose_launcher_is_killed_shuts_down_by_itself(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    # launcher.py stands in for `pagedserve up`: it starts a service with its own pid in the environment,
    # as the launcher does, then waits; the test kills it with SIGKILL, which it cannot pass on.
    service = ("from pagedserve.service import Service; "
               "Service('orphan-test', '127.0.0.1', 0).serve_until_signalled()")
    (tmp_path / "launcher.py").write_text(
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {service!r}], process_group=0,\n"
        "                         env={**os.environ, 'PAGEDSERVE_PARENT_PID': str(os.getpid())})\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py")], stdout=subprocess.PIPE, text=True,
                                cwd=os.getcwd())
    child_pid = int(launcher.stdout.readline())
    time.sleep(1.5)  # the service is up
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:  # gone, or a zombie its new parent has not reaped yet
            if open(f"/proc/{child_pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(child_pid, signal.SIGKILL)
    raise AssertionError("the service outlived its launcher")
