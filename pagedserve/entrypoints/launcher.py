"""Starts the four services as local processes, in dependency order, and stops them all together."""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import executor_svc.__main__
import frontend.__main__
import kvcache_svc.__main__
import scheduler_svc.__main__
from pagedserve.config import PagedServeConfig, to_argv
from pagedserve.service import INTERNAL_TOKEN_ENV, Security, channel, wait_until_serving

logger = logging.getLogger(__name__)

# In start order: each needs the ones before it.
SERVICES = {
    "executor_svc": executor_svc.__main__,
    "kvcache_svc": kvcache_svc.__main__,
    "scheduler_svc": scheduler_svc.__main__,
    "frontend": frontend.__main__,
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Stack:
    """The running services; use as a context manager, or call start() and stop().

    Port 0 (serving_config.port) serves the public API on a free port; the internal ports are always free
    ones, on the loopback interface whatever host the public API listens on. Without an internal token file
    the stack makes its own secret, handed to the services in their environment.
    """

    def __init__(self, config: PagedServeConfig) -> None:
        self.config = config
        self.processes: list[tuple[str, subprocess.Popen]] = []
        host = config.serving_config.host
        self.addresses = {module: f"127.0.0.1:{free_port()}" for module in SERVICES}
        self.addresses["frontend"] = f"{host}:{config.serving_config.listen_port('frontend') or free_port(host)}"
        self.env = dict(os.environ)
        if config.serving_config.internal_token_file is None:
            self.env[INTERNAL_TOKEN_ENV] = secrets.token_urlsafe(32)
        self.security = Security.from_config(config.serving_config, self.env)
        self.address = self.addresses["frontend"]
        self.executor_address = self.addresses["executor_svc"]
        self.kvcache_address = self.addresses["kvcache_svc"]
        self.scheduler_address = self.addresses["scheduler_svc"]

    def service_argv(self, module: str) -> list[str]:
        """The flags that give a service this stack's configuration: the flags its own parser declares."""
        host, port = self.addresses[module].rsplit(":", 1)
        serving = dataclasses.replace(
            self.config.serving_config, host=host, port=int(port),
            executor=self.executor_address, kvcache=self.kvcache_address, scheduler=self.scheduler_address,
        )
        return to_argv(dataclasses.replace(self.config, serving_config=serving), SERVICES[module].SECTIONS)

    def channel(self, module: str):
        """A channel to one of the services, with this stack's credentials (internal RPCs need its token)."""
        return channel(self.addresses[module], self.security)

    def start(self) -> "Stack":
        try:
            for module in SERVICES:
                self._spawn(module, self.addresses[module], self.service_argv(module))
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, module: str, address: str, args: list[str]) -> None:
        process = subprocess.Popen([sys.executable, "-m", module, *args], env=self.env)
        self.processes.append((module, process))
        deadline = time.monotonic() + self.config.serving_config.startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{module} exited with status {process.returncode} while starting")
            try:
                wait_until_serving(address, timeout=2.0, security=self.security)
                return
            except Exception:  # not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{module} did not report SERVING on {address}") from None

    def stop(self, timeout: float = 10.0) -> None:
        # Front to back, each gone before the next is told, so that no service is left calling one that
        # has already stopped (the scheduler finishes its step before the executor goes).
        for module, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", module)
                process.kill()
                process.wait()
        self.processes.clear()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
