"""`pagedserve up --compose docker-compose.yml`: the services a compose file describes, run as local processes
with the file's own commands, environment, ports, health checks and start order, so that tests run through
the compose file rather than trust it (no container engine needed).

What a container engine would give each container, a local run gives it this way:
- a network name: every service name (and network alias) stands for 127.0.0.1; a `NAME:PORT` in a command,
  a variable or a health check becomes `127.0.0.1:<the local port of NAME's PORT>`;
- its own ports: a port the file publishes (`ports:`) is the published host port, + k for replica k; any
  other port a service listens on (its `--port`, a `0.0.0.0:PORT` or `127.0.0.1:PORT` of its own) gets a
  free local port, as containers do not share a port space; `0.0.0.0` becomes the published host address,
  else 127.0.0.1;
- its image: `python` runs this interpreter; another program (redis-server for the redis image) must be
  installed here.
Variables are interpolated as compose does (`${VAR}`, `${VAR:-default}`, `${VAR:?error}`, `$$`), from the
launcher's environment; profiles, `deploy.replicas`, `depends_on` conditions and `stop_grace_period` are
honoured, and `--scale SERVICE=N` overrides the replicas.
"""
from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from pagedserve.config import INTERNAL_TOKEN_ENV, PARENT_PID_ENV
from pagedserve.entrypoints.launcher import (
    PYTHON_NAMES,
    SERVICES,
    LocalProcesses,
    free_port,
    replica_name,
)
from pagedserve.entrypoints.supervisor import RestartPolicy

# What compose waits for by default before stopping a container with SIGKILL.
DEFAULT_STOP_GRACE_S = 10.0
HEALTHCHECK_TIMEOUT_S = 30.0
LOCAL_HOST = "127.0.0.1"
_SELF_HOSTS = ("0.0.0.0", "127.0.0.1", "localhost")
# host:port; not the user:password of a URL (followed by @), nor a port that runs on into letters.
_ADDRESS = re.compile(r"(?<![\w.-])([A-Za-z0-9_.-]+):(\d{1,5})(?![\w@])")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)")
_DURATION_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}


class ComposeError(ValueError):
    """A compose file that cannot run here as it is written."""


# ---------------------------------------------------------------------------------------------- reading
def interpolate(text: str, environ: dict[str, str]) -> str:
    """Compose's variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
    ${VAR?error}, ${VAR:+other}, ${VAR+other} (defaults may hold variables themselves) and $$ for a $."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "$":
            out.append(text[i])
            i += 1
            continue
        following = text[i + 1:i + 2]
        if following == "$":
            out.append("$")
            i += 2
        elif following == "{":
            depth, end = 0, i + 1
            for end in range(i + 1, len(text)):
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if depth == 0:
                    break
            else:
                raise ComposeError(f"unclosed ${{ in {text!r}")
            out.append(_substitute(text[i + 2:end], environ))
            i = end + 1
        else:
            name = re.match(r"[A-Za-z_][A-Za-z0-9_]*", text[i + 1:])
            if name is None:
                raise ComposeError(f"a $ that starts no variable in {text!r} (write $$ for a $)")
            out.append(environ.get(name.group(), ""))
            i += 1 + name.end()
    return "".join(out)


def _substitute(body: str, environ: dict[str, str]) -> str:
    match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?", body, re.S)
    if match is None:
        raise ComposeError(f"${{{body}}} is not a variable")
    name, operator, argument = match.groups()
    value = environ.get(name)
    unset = value is None or (operator or "").startswith(":") and value == ""
    kind = (operator or "").lstrip(":")
    if kind == "-" and unset:
        return interpolate(argument, environ)
    if kind == "?" and unset:
        raise ComposeError(f"{name} must be set: {interpolate(argument, environ)}")
    if kind == "+":
        return "" if unset else interpolate(argument, environ)
    return value or ""


def _interpolate_all(node, environ: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, environ)
    if isinstance(node, list):
        return [_interpolate_all(item, environ) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_all(value, environ) for key, value in node.items()}
    return node


def load(path: str | os.PathLike, environ: dict[str, str] | None = None) -> dict:
    """The compose file as compose reads it: YAML (anchors and `<<` merges), then every value interpolated."""
    document = yaml.safe_load(Path(path).read_text())
    if not isinstance(document, dict) or not isinstance(document.get("services"), dict):
        raise ComposeError(f"{path}: no services")
    return _interpolate_all(document, dict(os.environ if environ is None else environ))


@dataclasses.dataclass(frozen=True)
class PublishedPort:
    host_ip: str  # "" for every interface
    first: int  # the host port of replica 0
    last: int  # the last host port of the range
    container: int


def parse_ports(entries: list) -> list[PublishedPort]:
    """Compose's short (`[IP:]HOST[-END]:CONTAINER[/tcp]`) and long (`{target, published, host_ip}`) syntax."""
    ports = []
    for entry in entries or []:
        if isinstance(entry, dict):
            host_ip, published, container = entry.get("host_ip", ""), str(entry.get("published", "")), entry["target"]
        else:
            parts = str(entry).split("/", 1)[0].rsplit(":", 2)
            if len(parts) == 1:
                raise ComposeError(f"port {entry!r} publishes no host port; give HOST:CONTAINER")
            host_ip, published, container = ("", *parts) if len(parts) == 2 else parts
        first, _, last = published.partition("-")
        ports.append(PublishedPort(host_ip.strip("[]"), int(first), int(last or first), int(container)))
    return ports


def parse_duration(value, default: float) -> float:
    """Compose durations: `1m30s`, `10s`, `500ms`, or plain seconds."""
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return float(value)
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ComposeError(f"{value!r} is not a duration")
    return sum(float(n) * _DURATION_S[u] for n, u in parts)


def _command(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(part) for part in value]


def _environment(value) -> dict[str, str]:
    if isinstance(value, list):
        return dict(item.split("=", 1) if "=" in item else (item, os.environ.get(item, "")) for item in value)
    return {key: "" if item is None else str(item) for key, item in (value or {}).items()}


def _healthcheck(value) -> list[str] | None:
    """The check as an argv (CMD-SHELL through sh -c); None without one."""
    if not value or value.get("disable"):
        return None
    test = value.get("test")
    if isinstance(test, str):
        return ["sh", "-c", test]
    if not test or test[0] == "NONE":
        return None
    if test[0] == "CMD-SHELL":
        return ["sh", "-c", " ".join(test[1:])]
    if test[0] == "CMD":
        return list(test[1:])
    raise ComposeError(f"healthcheck test {test!r} must start with CMD, CMD-SHELL or NONE")


@dataclasses.dataclass
class ComposeService:
    name: str
    image: str
    command: list[str]
    environment: dict[str, str]
    ports: list[PublishedPort]
    depends_on: dict[str, dict]  # {service: {condition, required}}
    healthcheck: list[str] | None
    replicas: int
    profiles: tuple[str, ...]
    stop_grace_s: float
    aliases: tuple[str, ...]


def services(document: dict) -> dict[str, ComposeService]:
    found = {}
    for name, spec in document["services"].items():
        depends = spec.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {dependency: {"condition": "service_started"} for dependency in depends}
        networks = spec.get("networks") or {}
        aliases = tuple(alias for network in (networks.values() if isinstance(networks, dict) else ())
                        for alias in ((network or {}).get("aliases") or ()))
        found[name] = ComposeService(
            name=name, image=str(spec.get("image", "")), command=_command(spec.get("command")),
            environment=_environment(spec.get("environment")), ports=parse_ports(spec.get("ports")),
            depends_on={dependency: dict(condition or {}) for dependency, condition in depends.items()},
            healthcheck=_healthcheck(spec.get("healthcheck")),
            replicas=int((spec.get("deploy") or {}).get("replicas", 1)), profiles=tuple(spec.get("profiles") or ()),
            stop_grace_s=parse_duration(spec.get("stop_grace_period"), DEFAULT_STOP_GRACE_S), aliases=aliases,
        )
    return found


def active(all_services: dict[str, ComposeService], profiles: tuple[str, ...]) -> dict[str, ComposeService]:
    """The services the profiles enable (one without profiles always), their dependencies on disabled
    services dropped where not required, as compose does; a required one refused."""
    enabled = {name: service for name, service in all_services.items()
               if not service.profiles or set(service.profiles) & set(profiles)}
    for service in enabled.values():
        for dependency, condition in list(service.depends_on.items()):
            if dependency in enabled:
                continue
            if dependency in all_services and condition.get("required") is False:
                del service.depends_on[dependency]
                continue
            raise ComposeError(f"service {service.name} depends on {dependency}, which "
                               + ("no profile given enables (--profile)" if dependency in all_services
                                  else "the file does not define"))
    return enabled


def start_stages(enabled: dict[str, ComposeService]) -> list[list[str]]:
    """The services in depends_on order, as stages: each after every one it depends on."""
    stages, placed = [], set()
    while len(placed) < len(enabled):
        stage = [name for name, service in enabled.items()
                 if name not in placed and set(service.depends_on) <= placed]
        if not stage:
            raise ComposeError(f"depends_on has a cycle among {sorted(set(enabled) - placed)}")
        stages.append(stage)
        placed.update(stage)
    return stages


# ---------------------------------------------------------------------------------------------- running
@dataclasses.dataclass(frozen=True)
class Replica:
    service: str
    index: int
    name: str  # the process name: the service's, or `service-k`


class ComposeStack(LocalProcesses):
    """The compose file's active services as local processes (see the module's doc), supervised like
    `pagedserve up`'s own: restarted when they die, stopped last started first, each given its
    stop_grace_period after SIGTERM."""

    def __init__(self, path: str | os.PathLike, scale: dict[str, int] | None = None, profiles: tuple[str, ...] = (),
                 environ: dict[str, str] | None = None, policy: RestartPolicy | None = None,
                 startup_timeout: float = 600.0) -> None:
        environ = dict(os.environ if environ is None else environ)
        # As `pagedserve up` does for its own stack: the internal RPCs, on loopback here, need a secret.
        if not environ.get(INTERNAL_TOKEN_ENV):
            environ[INTERNAL_TOKEN_ENV] = secrets.token_urlsafe(32)
        profiles = tuple(profiles) or tuple(p for p in environ.get("COMPOSE_PROFILES", "").split(",") if p)
        self.services = active(services(load(path, environ)), profiles)
        for name, count in (scale or {}).items():
            if name not in self.services:
                raise ComposeError(f"--scale {name}: no such service is enabled (profiles: {', '.join(profiles)})")
            self.services[name].replicas = count
        modules = [s.command[2] for s in self.services.values() if is_service_module(s.command)]
        waits = any(s.command[2] == "scheduler_svc" and "--executor" not in s.command
                    for s in self.services.values() if is_service_module(s.command))
        if waits and "executor_svc" not in modules:  # it would wait for an executor to register, in vain
            raise ComposeError("the scheduler drives the executors that register, but no enabled service runs "
                               "executor_svc (does a profile enable one? --profile)")
        self.names = {alias: service.name for service in self.services.values()
                      for alias in (service.name, *service.aliases)}
        self.replicas = {replica_name(service.name, k): Replica(service.name, k, replica_name(service.name, k))
                         for service in self.services.values() for k in range(service.replicas)}
        self.local_ports: dict[tuple[str, int, int], int] = {}
        self.environ = environ
        stages = [[replica.name for replica in self.replicas.values() if replica.service == service]
                  for stage in start_stages(self.services) for service in stage]
        super().__init__(stages, policy or RestartPolicy(1.0, 5), startup_timeout)
        # Every process's command is built now, so that a reference to nothing fails before anything starts.
        self.commands = {name: self._local_command(name, self.services[r.service].command)
                         for name, r in self.replicas.items()}
        self.checks = {name: self._local_command(name, self.services[r.service].healthcheck)
                       for name, r in self.replicas.items() if self.services[r.service].healthcheck}

    # -------------------------------------------------------------------------- addresses
    def listen_host(self, service: str) -> str:
        hosts = {port.host_ip or "0.0.0.0" for port in self.services[service].ports}
        if len(hosts) > 1:
            raise ComposeError(f"service {service} publishes on several host addresses {sorted(hosts)}; a local "
                               "run listens on one")
        return hosts.pop() if hosts else LOCAL_HOST

    def local_port(self, service: str, index: int, port: int) -> int:
        """Where replica `index` of a service listens locally for its container port."""
        key = (service, index, port)
        if key not in self.local_ports:
            published = [p for p in self.services[service].ports if p.container == port]
            if published:
                local = published[0].first + index
                if local > published[0].last and published[0].last != published[0].first:
                    raise ComposeError(f"service {service}: replica {index} has no host port left in "
                                       f"{published[0].first}-{published[0].last}")
            else:
                local = free_port(LOCAL_HOST)
            self.local_ports[key] = local
        return self.local_ports[key]

    def address(self, name: str, port: int) -> str:
        """The local host:port of a process's container port."""
        replica = self.replicas[name]
        host = self.listen_host(replica.service)
        return f"{LOCAL_HOST if host == '0.0.0.0' else host}:{self.local_port(replica.service, replica.index, port)}"

    def _rewrite(self, name: str, text: str) -> str:
        replica = self.replicas[name]

        def local(match: re.Match) -> str:
            host, port = match.group(1), int(match.group(2))
            if host in _SELF_HOSTS:
                listen = self.listen_host(replica.service) if host == "0.0.0.0" else LOCAL_HOST
                return f"{listen}:{self.local_port(replica.service, replica.index, port)}"
            if host in self.names:
                return f"{LOCAL_HOST}:{self.local_port(self.names[host], 0, port)}"
            if "." not in host and not host.isdigit():
                raise ComposeError(f"service {replica.service} refers to {host}:{port}, but no enabled service "
                                   f"is named {host} (does a profile enable it? --profile)")
            return match.group(0)

        return _ADDRESS.sub(local, text)

    def _local_command(self, name: str, argv: list[str]) -> list[str]:
        """The argv rewritten for a local run: addresses, `--port P`, `0.0.0.0`, and the program."""
        replica = self.replicas[name]
        if not argv:
            raise ComposeError(f"service {replica.service} has no command; a local run needs one")
        out = []
        for i, token in enumerate(argv):
            if i and argv[i - 1] == "--port" and token.isdigit():
                token = str(self.local_port(replica.service, replica.index, int(token)))
            elif token == "0.0.0.0":
                token = self.listen_host(replica.service)
            out.append(self._rewrite(name, token))
        program = out[0]
        if program in PYTHON_NAMES:
            out[0] = sys.executable
        elif program != "sh":
            found = shutil.which(program)
            if found is None:
                raise ComposeError(f"service {replica.service} (image {self.services[replica.service].image}) runs "
                                   f"{program}, which is not installed here")
            out[0] = found
        return out

    # -------------------------------------------------------------------------- LocalProcesses
    def command(self, name: str) -> list[str]:
        return self.commands[name]

    def environment(self, name: str) -> dict[str, str]:
        service = self.services[self.replicas[name].service]
        own = {key: self._rewrite(name, value) for key, value in service.environment.items()}
        return {**self.environ, **own, PARENT_PID_ENV: str(os.getpid())}

    def ready(self, name: str) -> bool:
        check = self.checks.get(name)
        if check is None:  # nothing to wait for but the start
            return True
        try:
            return subprocess.run(check, env=self.environment(name), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=HEALTHCHECK_TIMEOUT_S).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def stop_timeouts(self) -> dict[str, float]:
        return {name: self.services[replica.service].stop_grace_s for name, replica in self.replicas.items()}

    def listing(self) -> list[str]:
        """A line per process: its name and the local address of each port it listens on."""
        lines = []
        for name, replica in self.replicas.items():
            ports = sorted(port for (service, index, port) in self.local_ports
                           if (service, index) == (replica.service, replica.index))
            addresses = ", ".join(f"{self.address(name, port)} (port {port})" for port in ports)
            lines.append(f"{name}: {addresses or 'no port'}")
        return lines


def is_service_module(argv: list[str]) -> bool:
    """Whether a command runs one of the services (`python -m SERVICE ...`)."""
    return len(argv) > 2 and argv[0] in PYTHON_NAMES and argv[1] == "-m" and argv[2] in SERVICES
