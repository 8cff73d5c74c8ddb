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
]


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


class Service:
    """A gRPC server with the health service; SERVING once start() has returned."""

    def __init__(self, name: str, host: str, port: int, max_workers: int = 16) -> None:
        self.name = name
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"{name}: cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"

    def start(self) -> None:
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s serving on %s", self.name, self.address)

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
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
