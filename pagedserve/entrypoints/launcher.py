"""Starts the four services as local processes, in dependency order, restarts any that dies, and stops them
all together."""
from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import executor_svc.__main__
import frontend.__main__
import kvcache_svc.__main__
import scheduler_svc.__main__
from pagedserve.config import PagedServeConfig, to_argv
from pagedserve.entrypoints.supervisor import RestartPolicy, Supervisor
from pagedserve.service import INTERNAL_TOKEN_ENV, PARENT_PID_ENV, Security, channel, wait_until_serving

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
    """The running services, supervised: one that dies is restarted on the same address (see
    supervisor.py). Use as a context manager, or call start() and stop().

    Port 0 (serving_config.port) serves the public APIs (gRPC, and HTTP on http_address's host) on free
    ports, as does an http_address with port 0; the internal ports are always free ones, on the loopback
    interface whatever host the public API listens on. Without an internal token file
    the stack makes its own secret, handed to the services in their environment.
    """

    def __init__(self, config: PagedServeConfig) -> None:
        self.config = config
        host = config.serving_config.host
        self.addresses = {module: f"127.0.0.1:{free_port()}" for module in SERVICES}
        self.addresses["frontend"] = f"{host}:{config.serving_config.listen_port('frontend') or free_port(host)}"
        self.address = self.addresses["frontend"]
        http = config.serving_config.http_address
        if http:
            http_host, http_port = http.rsplit(":", 1)
            if config.serving_config.port == 0 or http_port == "0":
                http = f"{http_host}:{free_port(http_host.strip('[]'))}"
        self.http_address = http  # empty: no HTTP API
        self.http_url = f"http://{http}" if http else ""
        self.executor_address = self.addresses["executor_svc"]
        self.kvcache_address = self.addresses["kvcache_svc"]
        self.scheduler_address = self.addresses["scheduler_svc"]
        self.env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        if config.serving_config.internal_token_file is None:
            self.env[INTERNAL_TOKEN_ENV] = secrets.token_urlsafe(32)
        self.security = Security.from_config(config.serving_config, self.env)
        serving = config.serving_config
        self.supervisor = Supervisor(self._spawn, self._wait_serving,
                                     RestartPolicy(serving.restart_backoff, serving.max_restarts))

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        """The live process of each service, by module name."""
        return self.supervisor.processes

    def service_argv(self, module: str) -> list[str]:
        """The flags that give a service this stack's configuration: the flags its own parser declares."""
        host, port = self.addresses[module].rsplit(":", 1)
        serving = dataclasses.replace(
            self.config.serving_config, host=host, port=int(port), http_address=self.http_address,
            executor=self.executor_address, kvcache=self.kvcache_address, scheduler=self.scheduler_address,
        )
        return to_argv(dataclasses.replace(self.config, serving_config=serving), SERVICES[module].SECTIONS)

    def channel(self, module: str):
        """A channel to one of the services, with this stack's credentials (internal RPCs need its token)."""
        return channel(self.addresses[module], self.security)

    def start(self) -> "Stack":
        self.supervisor.start(list(SERVICES))
        return self

    def _spawn(self, module: str) -> subprocess.Popen:
        # A process group of its own: a Ctrl-C at the terminal reaches the launcher alone, which then
        # stops the services in order instead of all of them dying at once.
        return subprocess.Popen([sys.executable, "-m", module, *self.service_argv(module)], env=self.env,
                                process_group=0)

    def _wait_serving(self, module: str, process: subprocess.Popen, stopping: threading.Event) -> None:
        address = self.addresses[module]
        deadline = time.monotonic() + self.config.serving_config.startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{module} exited with status {process.returncode} while starting")
            if stopping.is_set():
                raise RuntimeError(f"stopped while {module} was starting")
            try:
                wait_until_serving(address, timeout=2.0, security=self.security)
                return
            except Exception:  # not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{module} did not report SERVING on {address}") from None

    def stop(self, timeout: float = 10.0) -> None:
        self.supervisor.stop(timeout)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
