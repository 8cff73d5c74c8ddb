"""Starts the services as local processes, in dependency order, restarts any that dies, and stops them all
together: `pagedserve up` from its configuration (Stack), or from a compose file (compose.py). Also reads a
service's command line as that service would, for the deployment files' tests."""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import io
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import executor_svc.__main__
import frontend.__main__
import kvcache_svc.__main__
import scheduler_svc.__main__
from pagedserve.config import (
    ENVIRONMENT,
    CacheConfig,
    PagedServeConfig,
    ServingConfig,
    format_cpu_list,
    parse_cpu_list,
    to_argv,
)
from pagedserve.entrypoints.supervisor import RestartPolicy, Supervisor
from pagedserve.service import INTERNAL_TOKEN_ENV, PARENT_PID_ENV, Security, channel, wait_until_serving

# In start order: each needs the ones before it.
SERVICES = {
    "executor_svc": executor_svc.__main__,
    "kvcache_svc": kvcache_svc.__main__,
    "scheduler_svc": scheduler_svc.__main__,
    "frontend": frontend.__main__,
}
# What control_plane_cpus is for: the two processes that call each other in turn every step.
CONTROL_PLANE = ("kvcache_svc", "scheduler_svc")
# Past a service's drain timeout, how long stopping waits for it before SIGKILL.
STOP_MARGIN_S = 10.0
# The interpreter names a command may start with; the launcher runs its own.
PYTHON_NAMES = ("python", "python3")
REDIS_PORT = 6379  # a redis:// URL without a port means this one


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports that are free now."""
    for _ in range(100):
        first = free_port(host)
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind((host, port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"found no {count} consecutive free ports on {host}")


def process_cpus(serving: ServingConfig, modules: dict[str, str]) -> dict[str, str | None]:
    """Each process's `cpus`: with control_plane_cpus, the scheduler and the KV-cache service on those and the
    other processes on the rest of the CPUs the stack may use (its own `cpus`, else the launcher's)."""
    if serving.control_plane_cpus is None:
        return dict.fromkeys(modules, serving.cpus)
    given = parse_cpu_list(serving.cpus) if serving.cpus is not None else frozenset(os.sched_getaffinity(0))
    control = parse_cpu_list(serving.control_plane_cpus, "control_plane_cpus")
    if not control <= given:
        raise ValueError(f"control_plane_cpus names CPUs {format_cpu_list(control - given)} that the stack may "
                         f"not use (it may use {format_cpu_list(given)})")
    if not given - control:
        raise ValueError(f"control_plane_cpus takes every CPU the stack may use ({format_cpu_list(given)}): none "
                         "is left for the frontends and the executors")
    return {name: format_cpu_list(control if module in CONTROL_PLANE else given - control)
            for name, module in modules.items()}


def replica_name(module: str, index: int) -> str:
    """A replica's process name: the service's own for the first, `name-k` for the k-th."""
    return module if index == 0 else f"{module}-{index}"


# ---------------------------------------------------------------------------------------------- commands
class CommandError(ValueError):
    """A command line that its service would refuse."""


@dataclasses.dataclass(frozen=True)
class ServiceCommand:
    """`python -m MODULE FLAGS...` read by MODULE's own parser (built from pagedserve/config.py)."""

    module: str
    configs: dict  # {config class: instance}, as the service would start with them

    @property
    def serving(self) -> ServingConfig:
        return self.configs[ServingConfig]

    def listen_ports(self) -> set[int]:
        """The ports the service listens on: its gRPC port, and the frontend's HTTP port."""
        ports = {self.serving.listen_port(self.module)}
        if self.module == "frontend" and self.serving.http_address:
            ports.add(int(self.serving.http_address.rsplit(":", 1)[1]))
        return ports

    def peers(self) -> list[tuple[str, int]]:
        """(host, port) of every service this one calls, Redis included."""
        found = [getattr(self.serving, name) for name in ("executor", "kvcache", "scheduler")]
        addresses = [(host, int(port)) for host, port in (a.rsplit(":", 1) for a in found if a)]
        cache = self.configs.get(CacheConfig)
        if cache is not None and cache.redis_url:
            url = urllib.parse.urlsplit(cache.redis_url)
            addresses.append((url.hostname, url.port or REDIS_PORT))
        return addresses


def parse_service_command(argv: list[str], environment: tuple[str, ...] = ()) -> ServiceCommand:
    """Reads a container's command as its service would: `python -m MODULE FLAGS...` with MODULE a service,
    every flag one it declares with a value it accepts, and every variable of `environment` (those the
    container gives the service, less those its command line consumes) one it reads. Raises CommandError
    saying what is wrong."""
    if len(argv) < 3 or argv[0] not in (*PYTHON_NAMES, sys.executable) or argv[1] != "-m":
        raise CommandError(f"{' '.join(argv[:3])!r}: not `python -m SERVICE ...`")
    module = argv[2]
    if module not in SERVICES:
        raise CommandError(f"{module!r} is not a service (one of {', '.join(SERVICES)})")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            configs = SERVICES[module].parse_args(argv[3:])
    except SystemExit:
        raise CommandError(f"{module}: {errors.getvalue().strip().splitlines()[-1]}") from None
    for name in environment:
        if module not in ENVIRONMENT.get(name, ((),))[0]:
            raise CommandError(f"{module} does not read the environment variable {name}")
    return ServiceCommand(module, configs)


# ---------------------------------------------------------------------------------------------- processes
class LocalProcesses(abc.ABC):
    """Named processes started in stages (see supervisor.py), each ready once its health check passes,
    restarted when they die and stopped together. A subclass says what each one runs."""

    def __init__(self, stages: list[list[str]], policy: RestartPolicy, startup_timeout: float) -> None:
        self.stages = stages
        self.startup_timeout = startup_timeout
        self.supervisor = Supervisor(self._spawn, self._wait_ready, policy)

    @abc.abstractmethod
    def command(self, name: str) -> list[str]:
        """The argv that starts the process of that name."""

    @abc.abstractmethod
    def environment(self, name: str) -> dict[str, str]:
        """The environment it runs with."""

    @abc.abstractmethod
    def ready(self, name: str) -> bool:
        """One health check of a started process."""

    @abc.abstractmethod
    def stop_timeouts(self) -> dict[str, float]:
        """{name: seconds it may take to stop after SIGTERM}."""

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        """The live process of each name."""
        return self.supervisor.processes

    def start(self):
        self.supervisor.start(self.stages)
        return self

    def stop(self) -> None:
        self.supervisor.stop(timeouts=self.stop_timeouts())

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str) -> subprocess.Popen:
        # A process group of its own: a Ctrl-C at the terminal reaches the launcher alone, which then
        # stops the services in order instead of all of them dying at once.
        return subprocess.Popen(self.command(name), env=self.environment(name), process_group=0)

    def _wait_ready(self, name: str, process: subprocess.Popen, stopping: threading.Event) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode} while starting")
            if stopping.is_set():
                raise RuntimeError(f"stopped while {name} was starting")
            if self.ready(name):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not pass its health check within {self.startup_timeout:g} s")
            time.sleep(0.2)


class Stack(LocalProcesses):
    """`pagedserve up`: the services of a configuration, supervised: one that dies is restarted on the same
    address (see supervisor.py). Use as a context manager, or call start() and stop().

    `frontends` frontends: frontend k (process `frontend-k`, the first just `frontend`) serves the public
    gRPC API on the public port + k and the HTTP API on the HTTP port + k. Port 0 (serving_config.port)
    serves the public APIs (gRPC, and HTTP on http_address's host) on free ports, as does an http_address
    with port 0; the internal ports are always free ones, on the loopback interface whatever host the public
    API listens on, an executor's replicas on consecutive ones. Without an internal token file the stack
    makes its own secret, handed to the services in their environment.
    """

    def __init__(self, config: PagedServeConfig) -> None:
        serving = config.serving_config
        self.config = config
        counts = {"executor_svc": serving.executors, "kvcache_svc": 1, "scheduler_svc": 1,
                  "frontend": serving.frontends}
        stages = [[replica_name(module, k) for k in range(counts[module])] for module in SERVICES]
        self.modules = {name: module for module, stage in zip(SERVICES, stages) for name in stage}
        self.addresses: dict[str, str] = {}
        for module, stage in zip(SERVICES, stages):
            host = serving.host if module == "frontend" else "127.0.0.1"
            first = (serving.listen_port("frontend") if module == "frontend" else 0) or free_ports(len(stage), host)
            self.addresses.update({name: f"{host}:{first + k}" for k, name in enumerate(stage)})
        self.cpus = process_cpus(serving, self.modules)
        self.frontends = stages[-1]
        self.address = self.addresses["frontend"]
        self.http_addresses = {name: "" for name in self.frontends}  # empty: no HTTP API
        if serving.http_address:
            http_host, http_port = serving.http_address.rsplit(":", 1)
            first = int(http_port)
            if serving.port == 0 or first == 0:
                first = free_ports(len(self.frontends), http_host.strip("[]"))
            self.http_addresses = {name: f"{http_host}:{first + k}" for k, name in enumerate(self.frontends)}
        self.http_address = self.http_addresses["frontend"]
        self.http_url = f"http://{self.http_address}" if self.http_address else ""
        self.executor_address = self.addresses["executor_svc"]
        self.kvcache_address = self.addresses["kvcache_svc"]
        self.scheduler_address = self.addresses["scheduler_svc"]
        self.env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        if serving.internal_token_file is None:
            self.env[INTERNAL_TOKEN_ENV] = secrets.token_urlsafe(32)
        self.security = Security.from_config(serving, self.env)
        super().__init__(stages, RestartPolicy(serving.restart_backoff, serving.max_restarts),
                         serving.startup_timeout)

    def listing(self) -> list[str]:
        """A line per process: its name and address, the frontends' HTTP API too."""
        lines = []
        for name, address in self.addresses.items():
            http = self.http_addresses.get(name)
            lines.append(f"{name}: {address}" + (f" (HTTP http://{http}/v1)" if http else ""))
        return lines

    def service_argv(self, name: str) -> list[str]:
        """The flags that give a process this stack's configuration: the flags its own parser declares."""
        module = self.modules[name]
        host, port = self.addresses[name].rsplit(":", 1)
        # One executor: the KV-cache service and the scheduler follow it through --executor, and it does not
        # register. Several: each registers with the KV-cache service, where the scheduler finds them.
        several = self.config.serving_config.executors > 1
        serving = dataclasses.replace(
            self.config.serving_config, host=host, port=int(port), http_address=self.http_addresses.get(name, ""),
            executor=None if several else self.executor_address, scheduler=self.scheduler_address,
            kvcache=None if module == "executor_svc" and not several else self.kvcache_address,
            advertise_address=self.addresses[name] if several and module == "executor_svc" else None,
            cpus=self.cpus[name],
            nice=self._nice(module),
        )
        return to_argv(dataclasses.replace(self.config, serving_config=serving), SERVICES[module].SECTIONS)

    def _nice(self, module: str) -> int | None:
        serving = self.config.serving_config
        return serving.frontend_nice if module == "frontend" and serving.frontend_nice is not None else serving.nice

    def channel(self, name: str):
        """A channel to one of the processes, with this stack's credentials (internal RPCs need its token)."""
        return channel(self.addresses[name], self.security)

    def command(self, name: str) -> list[str]:
        return [sys.executable, "-m", self.modules[name], *self.service_argv(name)]

    def environment(self, name: str) -> dict[str, str]:
        return self.env

    def ready(self, name: str) -> bool:
        try:
            wait_until_serving(self.addresses[name], timeout=2.0, security=self.security)
        except Exception:  # not listening yet, or not serving yet
            return False
        return True

    def stop_timeouts(self) -> dict[str, float]:
        return {name: self.config.serving_config.drain_timeout_s + STOP_MARGIN_S for name in self.modules}

