"""What every gRPC service process shares: channels, a server with the standard health service, and
serving until SIGTERM or SIGINT."""
from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

# Prompts of a long context and big batches make messages larger than gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer that restarts is found again within a second (gRPC's own backoff grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# Each dependency's health is checked this often, each check given this long to answer.
HEALTH_POLL_S = 0.5
HEALTH_TIMEOUT_S = 0.5


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def wait_until_serving(address: str, timeout: float) -> None:
    """Blocks until the server at address answers its health check with SERVING."""
    with channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=timeout)
        health_check = health_pb2_grpc.HealthStub(ch)
        status = health_check.Check(health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=True).status
        if status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{address} is not serving (status {status})")


class DependencyWatcher:
    """Checks the health of the services this one needs, every HEALTH_POLL_S, and reports whether all of
    them are SERVING. A dependency that is down, unreachable or NOT_SERVING itself (one of its own is down)
    counts as down, so the state travels up the chain to the frontend."""

    def __init__(self, dependencies: dict[str, str], on_change) -> None:
        """dependencies: {name: address}; on_change(healthy: bool, down: list[str]) after every change."""
        self.channels = {name: channel(address) for name, address in dependencies.items()}
        self.stubs = {name: health_pb2_grpc.HealthStub(ch) for name, ch in self.channels.items()}
        self.on_change = on_change
        self.down: list[str] | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dependency-health", daemon=True)

    def check(self) -> None:
        down = [name for name, stub in self.stubs.items() if not self._serving(stub)]
        if down != self.down:
            self.down = down
            self.on_change(not down, down)

    @staticmethod
    def _serving(stub) -> bool:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S).status
        except grpc.RpcError:
            return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def start(self) -> None:
        self.check()
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(HEALTH_POLL_S):
            self.check()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()
        for ch in self.channels.values():
            ch.close()


class Service:
    """A gRPC server with the health service: SERVING once start() has returned, and while every one of
    its dependencies ({name: address}) is SERVING."""

    def __init__(self, name: str, host: str, port: int, max_workers: int = 16,
                 dependencies: dict[str, str] | None = None) -> None:
        self.name = name
        self.watcher = DependencyWatcher(dependencies, self._dependencies_changed) if dependencies else None
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"{name}: cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"

    def start(self) -> None:
        self.server.start()
        if self.watcher is not None:
            self.watcher.start()
        else:
            self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s serving on %s", self.name, self.address)

    def _dependencies_changed(self, healthy: bool, down: list[str]) -> None:
        if healthy:
            self.health.set("", health_pb2.HealthCheckResponse.SERVING)
            logger.info("%s: every dependency is serving; SERVING", self.name)
        else:
            self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            logger.warning("%s: %s not serving; NOT_SERVING until it is", self.name, ", ".join(down))

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        if self.watcher is not None:
            self.watcher.stop()
        self.server.stop(grace).wait()

    def serve_until_signalled(self, on_stop=None, main_loop=None) -> None:
        """Runs until SIGTERM or SIGINT, then stops accepting calls and shuts down cleanly. main_loop, if
        given, runs on this (the main) thread until the stop event is set."""
        stopping = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopping.set())
        self.start()
        if main_loop is not None:
            main_loop(stopping)
        stopping.wait()
        logger.info("%s shutting down", self.name)
        if on_stop is not None:
            on_stop()
        self.stop()


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
