"""The supervisor with real child processes: a killed one comes back, one that keeps failing is given up on
after the configured number of rapid failures with a doubling backoff, and stopping stops every process in
reverse start order without restarting any."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from pagedserve.entrypoints.supervisor import RestartPolicy, Supervisor

# Sleeps until SIGTERM, then writes its name to the file and exits.
SLEEPER = """
import signal, sys, time
name, path = sys.argv[1], sys.argv[2]
def stop(*_):
    with open(path, "a") as f:
        f.write(name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(600)
"""


class Children:
    """Starts `python -c code name path` per name and counts the starts; ready once it has said so."""

    def __init__(self, code: str, path) -> None:
        self.code, self.path = code, str(path)
        self.started: list[str] = []

    def spawn(self, name: str) -> subprocess.Popen:
        self.started.append(name)
        return subprocess.Popen([sys.executable, "-c", self.code, name, self.path], stdout=subprocess.PIPE, text=True)

    @staticmethod
    def wait_ready(name: str, process: subprocess.Popen, stopping) -> None:
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{name} exited with status {process.wait()} while starting")


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(backoff=0.5, max_restarts=10, cap=3.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_killed_process_is_restarted_and_the_restart_logged(tmp_path, caplog):
    children = Children(SLEEPER, tmp_path / "stopped")
    supervisor = Supervisor(children.spawn, children.wait_ready, RestartPolicy(backoff=0.05, max_restarts=3))
    caplog.set_level(logging.WARNING, logger="pagedserve.entrypoints.supervisor")
    supervisor.start([["a"], ["b"]])
    try:
        first = supervisor.processes["b"]
        os.kill(first.pid, signal.SIGKILL)
        assert wait_for(lambda: supervisor.restarts.get("b") == 1)
        assert supervisor.processes["b"].pid != first.pid and supervisor.processes["b"].poll() is None
        assert children.started == ["a", "b", "b"]
        assert "b died (killed by SIGKILL)" in caplog.text and "attempt 1 of 3" in caplog.text
        assert "b restarted" in caplog.text
        assert not supervisor.gave_up.is_set()
    finally:
        supervisor.stop()


def test_rapid_failures_back_off_and_end_in_giving_up(caplog):
    failing = Children("import sys; print('ready', flush=True); sys.exit(3)", "-")
    supervisor = Supervisor(failing.spawn, failing.wait_ready, RestartPolicy(backoff=0.2, max_restarts=2))
    caplog.set_level(logging.WARNING, logger="pagedserve.entrypoints.supervisor")
    supervisor.start([["flaky"]])
    try:
        assert supervisor.gave_up.wait(10)
        assert failing.started == ["flaky"] * 3  # the first start and two restarts
        assert "restarting it in 0.2 s (attempt 1 of 2)" in caplog.text
        assert "restarting it in 0.4 s (attempt 2 of 2)" in caplog.text
        assert "flaky (exit status 3) failed 3 times in a row" in supervisor.failure
        time.sleep(0.3)
        assert failing.started == ["flaky"] * 3, "restarted after giving up"
    finally:
        supervisor.stop()


def test_stop_is_last_started_first_and_restarts_nothing(tmp_path):
    stopped = tmp_path / "stopped"
    children = Children(SLEEPER, stopped)
    supervisor = Supervisor(children.spawn, children.wait_ready, RestartPolicy(backoff=0.01, max_restarts=5))
    supervisor.start([["executor"], ["kvcache"], ["scheduler"], ["frontend"]])
    processes = list(supervisor.processes.values())
    supervisor.stop()
    assert stopped.read_text().split() == ["frontend", "scheduler", "kvcache", "executor"]
    assert all(p.poll() is not None for p in processes)
    time.sleep(0.2)
    assert len(children.started) == 4


def test_a_failed_start_stops_what_was_started(tmp_path):
    code = SLEEPER.replace('print("ready", flush=True)', 'name == "bad" and sys.exit(2); print("ready", flush=True)')
    children = Children(code, tmp_path / "stopped")
    supervisor = Supervisor(children.spawn, children.wait_ready, RestartPolicy(backoff=0.01, max_restarts=5))
    with pytest.raises(RuntimeError, match="bad exited with status 2"):
        supervisor.start([["good"], ["bad"], ["never"]])
    assert children.started == ["good", "bad"]
    assert (tmp_path / "stopped").read_text().split() == ["good"]


# Writes when SIGTERM came, then takes a second to stop, as a draining service would.
SLOW_STOPPER = """
import signal, sys, time
name, path = sys.argv[1], sys.argv[2]
def stop(*_):
    with open(path, "a") as f:
        f.write(f"{name} {time.monotonic()}\\n")
    time.sleep(1.0)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(600)
"""


def test_the_replicas_of_a_stage_stop_together_and_before_the_stage_they_need(tmp_path):
    stopped = tmp_path / "stopped"
    children = Children(SLOW_STOPPER, stopped)
    supervisor = Supervisor(children.spawn, children.wait_ready, RestartPolicy(backoff=0.01, max_restarts=5))
    supervisor.start([["scheduler"], ["frontend", "frontend-1"]])
    assert sorted(supervisor.processes) == ["frontend", "frontend-1", "scheduler"]
    supervisor.stop()
    signalled = dict(line.split() for line in stopped.read_text().splitlines())
    assert list(signalled)[-1] == "scheduler"
    frontends = [float(signalled[name]) for name in ("frontend", "frontend-1")]
    # Together: one after the other would put a whole second of stopping between them.
    assert abs(frontends[0] - frontends[1]) < 0.5
    assert float(signalled["scheduler"]) - max(frontends) >= 0.9
