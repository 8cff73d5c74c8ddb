"""How `pagedserve up --compose` reads a compose file and turns it into local processes: compose's variable
substitution, ports, profiles and start order, and each command rewritten for one host (service names to
127.0.0.1, published ports offset per replica, the others free)."""
from __future__ import annotations

import sys
import textwrap

import pytest

from pagedserve.entrypoints.compose import (
    ComposeError,
    ComposeStack,
    PublishedPort,
    interpolate,
    parse_ports,
    start_stages,
)

ENV = {"SET": "value", "EMPTY": ""}


@pytest.mark.parametrize("text,expected", [
    ("$SET and ${SET}", "value and value"),
    ("${UNSET:-fallback} ${EMPTY:-fallback} [${EMPTY-unused}] ${UNSET-used}", "fallback fallback [] used"),
    ("${UNSET:-${SET}}", "value"),
    ("${SET:+other} ${UNSET:+other}", "other "),
    ("$$SET costs $$5", "$SET costs $5"),
    ("${UNSET}", ""),
])
def test_variables_are_substituted_as_compose_does(text, expected):
    assert interpolate(text, ENV) == expected


def test_a_required_variable_that_is_unset_is_an_error_with_its_message():
    with pytest.raises(ComposeError, match="UNSET must be set: give it"):
        interpolate("${UNSET:?give it}", ENV)
    with pytest.raises(ComposeError, match="EMPTY must be set"):
        interpolate("${EMPTY:?}", ENV)
    assert interpolate("${EMPTY?}", ENV) == ""


def test_published_ports_in_short_and_long_syntax():
    assert parse_ports(["127.0.0.1:50051-50058:50051", "8000:8000/tcp",
                        {"target": 9000, "published": "9100", "host_ip": "127.0.0.1"}]) == [
        PublishedPort("127.0.0.1", 50051, 50058, 50051), PublishedPort("", 8000, 8000, 8000),
        PublishedPort("127.0.0.1", 9100, 9100, 9000)]
    with pytest.raises(ComposeError, match="publishes no host port"):
        parse_ports(["8000"])


def write(tmp_path, text: str):
    path = tmp_path / "compose.yml"
    path.write_text(textwrap.dedent(text))
    return path


TOPOLOGY = """
    services:
      back:
        image: x
        command: python -m scheduler_svc --host 0.0.0.0 --port 7000 --kvcache side:7100 --executor side:7100
      side:
        image: x
        profiles: [extra]
        command: python -m kvcache_svc --host 0.0.0.0 --port 7100 --executor back:7000
        networks: {default: {aliases: [alias]}}
      front:
        image: x
        command: python -m frontend --host 0.0.0.0 --port 7200 --scheduler back:7000 --http-address 0.0.0.0:7300
        environment: {TARGET: "alias:7100", OTHER: plain}
        ports: ["127.0.0.1:${FRONT_PORTS:-17200-17209}:7200", "127.0.0.1:17300:7300"]
        depends_on: {back: {condition: service_healthy}, side: {condition: service_healthy, required: false}}
        healthcheck: {test: [CMD, python, -m, pagedserve.healthcheck, "127.0.0.1:7200"]}
    """


def test_a_local_run_rewrites_names_and_ports_per_replica(tmp_path):
    stack = ComposeStack(write(tmp_path, TOPOLOGY), {"front": 2}, ("extra",), environ={})
    assert stack.stages == [["back"], ["side"], ["front", "front-1"]]
    back = stack.local_port("back", 0, 7000)
    assert stack.command("back")[:6] == [sys.executable, "-m", "scheduler_svc", "--host", "127.0.0.1", "--port"]
    assert stack.command("back")[6] == str(back)
    for k, name in enumerate(("front", "front-1")):
        assert stack.command(name)[5:] == [
            "--port", str(17200 + k), "--scheduler", f"127.0.0.1:{back}", "--http-address", f"127.0.0.1:{17300 + k}"]
        assert stack.checks[name][-1] == f"127.0.0.1:{17200 + k}"
    side = stack.local_port("side", 0, 7100)
    # A URL's user:password is no address, whatever digits the password starts with.
    for password in ("14ab", "1234"):
        assert stack._rewrite("front", f"redis://default:{password}@alias:7100/0") == \
            f"redis://default:{password}@127.0.0.1:{side}/0"
    assert stack.environment("front-1")["TARGET"] == f"127.0.0.1:{side}"  # an alias is its service
    assert stack.environment("front-1")["OTHER"] == "plain"
    assert stack.stop_timeouts()["front"] == 10.0  # compose's default stop_grace_period
    assert "front-1: 127.0.0.1:17201 (port 7200), 127.0.0.1:17301 (port 7300)" in stack.listing()


def test_a_disabled_optional_dependency_is_dropped_and_a_reference_to_it_refused(tmp_path):
    with pytest.raises(ComposeError, match="service back refers to side:7100, but no enabled service is named side"):
        ComposeStack(write(tmp_path, TOPOLOGY), environ={})


def test_start_order_follows_depends_on_and_a_cycle_is_refused(tmp_path):
    stack = ComposeStack(write(tmp_path, TOPOLOGY), environ={}, profiles=("extra",))
    assert start_stages(stack.services) == [["back", "side"], ["front"]]
    stack.services["back"].depends_on["front"] = {}
    with pytest.raises(ComposeError, match="cycle"):
        start_stages(stack.services)


def test_a_replica_past_its_published_range_or_a_missing_program_is_refused(tmp_path):
    with pytest.raises(ComposeError, match="replica 2 has no host port left in 17200-17201"):
        ComposeStack(write(tmp_path, TOPOLOGY), {"front": 3}, ("extra",), environ={"FRONT_PORTS": "17200-17201"})
    missing = TOPOLOGY.replace("python -m kvcache_svc", "no-such-program-here")
    with pytest.raises(ComposeError, match="runs no-such-program-here, which is not installed here"):
        ComposeStack(write(tmp_path, missing), environ={}, profiles=("extra",))
