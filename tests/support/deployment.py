"""What the compose file's and the Kubernetes manifests' tests check of every container that runs a service:
the command is one its service accepts, and its ports, probes and peers line up with what it listens on."""
from __future__ import annotations

from pagedserve.entrypoints.launcher import ServiceCommand, parse_service_command


def check_service(where: str, argv: list[str], environment: tuple[str, ...], ports: set[int],
                  probe_ports: set[int]) -> ServiceCommand:
    """argv: the container's command (variables resolved); environment: the variable names it is given;
    ports: those it declares (published, containerPort); probe_ports: those its health checks ask. Raises
    AssertionError naming `where` and what is wrong."""
    try:
        command = parse_service_command(argv, environment)
    except ValueError as error:
        raise AssertionError(f"{where}: {error}") from None
    listening = command.listen_ports()
    assert ports <= listening, f"{where}: declares ports {sorted(ports - listening)} it does not listen on"
    assert probe_ports <= listening, f"{where}: health checks ask ports {sorted(probe_ports - listening)} " \
                                     f"it does not listen on"
    return command


def check_peers(where: str, command: ServiceCommand, listening: dict[str, set[int]]) -> None:
    """Every service the command calls is one of listening ({name: ports}) on one of its ports."""
    for host, port in command.peers():
        assert host in listening, f"{where}: calls {host}:{port}, which is no service here"
        assert port in listening[host], f"{where}: calls {host}:{port}, but {host} listens on {sorted(listening[host])}"
