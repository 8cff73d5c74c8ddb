"""A service's health follows its dependencies': NOT_SERVING while one is down or not serving itself, and
SERVING again once it is back on the same address; and while it drains, whatever its dependencies do."""
from __future__ import annotations

import contextlib
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import pagedserve.service
from pagedserve.service import HEALTH_POLL_S, LIVENESS_SERVICE, Service, channel

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


def liveness(address: str):
    with channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE),
                                                    timeout=1.0).status


class Requests:
    """A drainable with a count of requests in flight."""

    def __init__(self, in_flight: int) -> None:
        self.in_flight, self.draining = in_flight, False

    def start_draining(self) -> None:
        self.draining = True

    def idle(self) -> bool:
        return self.in_flight == 0


class ObservedHealth(health.HealthServicer):
    """The health service, counting its Checks, and able to hang: while hung, Check answers late and Watch
    not at all, until the hang ends (as a process stuck for a while would)."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0
        self.hung = threading.Event()
        self.held_watches = []

    def Check(self, request, context):
        self.checks += 1
        if self.hung.is_set():
            time.sleep(2 * pagedserve.service.HEALTH_TIMEOUT_S)
        return super().Check(request, context)

    def Watch(self, request, context, send_response_callback=None):
        if self.hung.is_set():
            self.held_watches.append((request, context, send_response_callback))
            return None
        return super().Watch(request, context, send_response_callback)

    def recover(self) -> None:
        self.hung.clear()
        for held in self.held_watches:
            super().Watch(*held)


class ObservedService(Service):
    @staticmethod
    def _make_server(options, security, public, max_workers):
        server, _ = Service._make_server(options, security, public, max_workers)
        return server, ObservedHealth()


@contextlib.contextmanager
def executor_and_scheduler(executor_cls=ObservedService):
    """An executor (observed, by default) and a scheduler that needs it, both started and SERVING; stopped
    after."""
    executor = executor_cls("executor", "127.0.0.1", 0)
    executor.start()
    scheduler = Service("scheduler", "127.0.0.1", 0, dependencies={"executor": executor.address})
    scheduler.start()
    try:
        assert status(scheduler.address) == SERVING
        yield executor, scheduler
    finally:
        scheduler.stop(grace=0)
        executor.stop(grace=0)


def test_dependencies_are_watched_not_polled_and_a_change_arrives_at_once():
    with executor_and_scheduler() as (executor, scheduler):
        checks = executor.health.checks
        time.sleep(6 * HEALTH_POLL_S)
        assert executor.health.checks == checks, "a healthy dependency is not polled"
        executor.health.set("", NOT_SERVING)
        assert becomes(scheduler.address, NOT_SERVING, timeout=1.0)
        executor.health.set("", SERVING)
        assert becomes(scheduler.address, SERVING, timeout=1.0)
        executor.server.stop(0).wait()  # the stream breaks with the process
        assert becomes(scheduler.address, NOT_SERVING, timeout=1.0)


def test_a_dependency_that_hangs_is_down_until_it_answers_again(monkeypatch):
    monkeypatch.setattr(pagedserve.service, "HEALTH_CHECK_EVERY_S", 0.2)
    with executor_and_scheduler() as (executor, scheduler):
        executor.health.hung.set()  # its open stream stays open, answering nothing
        assert becomes(scheduler.address, NOT_SERVING)
        time.sleep(4 * HEALTH_POLL_S)
        assert status(scheduler.address) == NOT_SERVING, "a stream opened during the hang has not answered"
        executor.health.recover()
        assert becomes(scheduler.address, SERVING)


def test_a_drain_is_not_serving_until_its_requests_finish_and_a_dependency_does_not_undo_it():
    with executor_and_scheduler(Service) as (dependency, service):
        assert liveness(service.address) == SERVING
        requests = Requests(in_flight=1)
        done = threading.Event()
        threading.Thread(target=lambda: done.set() if service.drain(requests, timeout=30) else None).start()
        assert becomes(service.address, NOT_SERVING) and requests.draining
        # The dependency going away and coming back must not make a draining service SERVING again.
        dependency.health.set("", NOT_SERVING)
        time.sleep(3 * HEALTH_POLL_S)
        dependency.health.set("", SERVING)
        time.sleep(3 * HEALTH_POLL_S)
        assert status(service.address) == NOT_SERVING
        assert liveness(service.address) == SERVING, "draining is not dying: liveness stays up"
        assert not done.is_set()
        requests.in_flight = 0
        assert done.wait(5)


def test_a_drain_gives_up_at_its_timeout_or_at_a_second_signal():
    service = Service("frontend", "127.0.0.1", 0)
    service.start()
    try:
        started = time.monotonic()
        assert service.drain(Requests(in_flight=1), timeout=0.5) is False
        assert 0.5 <= time.monotonic() - started < 2.0
        interrupted = threading.Event()
        interrupted.set()
        started = time.monotonic()
        assert service.drain(Requests(in_flight=1), timeout=30, interrupted=interrupted) is False
        assert time.monotonic() - started < 1.0
    finally:
        service.stop(grace=0)
