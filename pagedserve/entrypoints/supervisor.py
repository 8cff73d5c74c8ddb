"""Keeps a set of processes running: one that exits, for whatever reason (a crash, the OOM killer, SIGKILL,
even a clean exit nobody asked for), is started again with the same command line, so on the same address,
after a backoff that doubles with each rapid failure in a row. After too many rapid failures the
supervisor gives up on it and says so; stopping stops every process, last started first, and restarts
nothing from then on.

Processes start in stages: those of a stage together (replicas of one service), each stage once every
process of the one before serves; they stop stage by stage the other way round, a stage's processes
together, so that replicas drain at the same time rather than one after another."""
from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.config import RESTART_BACKOFF_CAP_S, RESTART_STABLE_S

logger = logging.getLogger(__name__)

# How often a supervising thread looks at its process.
POLL_S = 0.1


@dataclass(frozen=True)
class RestartPolicy:
    backoff: float  # seconds before the first restart
    max_restarts: int  # rapid failures in a row tolerated
    cap: float = RESTART_BACKOFF_CAP_S
    stable_s: float = RESTART_STABLE_S  # a run at least this long was not a rapid failure

    def delay(self, failures: int) -> float:
        """Seconds to wait before restarting after the failures-th rapid failure in a row (1, 2, ...)."""
        return min(self.backoff * 2 ** (failures - 1), self.cap)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class Supervisor:
    """spawn(name) starts a named process; wait_ready(name, process, stopping) blocks until it serves and
    raises if it exits first, does not come up in time, or stopping is set."""

    def __init__(
        self,
        spawn: Callable[[str], subprocess.Popen],
        wait_ready: Callable[[str, subprocess.Popen, threading.Event], None],
        policy: RestartPolicy,
    ) -> None:
        self.spawn = spawn
        self.wait_ready = wait_ready
        self.policy = policy
        self.processes: dict[str, subprocess.Popen] = {}
        self.stages: list[list[str]] = []
        self.restarts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.gave_up = threading.Event()
        self.failure: str | None = None
        self.threads: list[threading.Thread] = []

    def start(self, stages: list[list[str]]) -> None:
        """Starts each stage's processes, all of them serving before the next stage starts, then supervises
        them all."""
        try:
            for stage in stages:
                self.stages.append(stage)
                started = [(name, self._spawn(name)) for name in stage]
                for name, process in started:
                    self.wait_ready(name, process, self.stopping)
        except BaseException:
            self.stop()
            raise
        for name in (name for stage in stages for name in stage):
            thread = threading.Thread(target=self._supervise, args=(name,), name=f"supervise-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def _spawn(self, name: str) -> subprocess.Popen:
        with self.lock:
            if self.stopping.is_set():
                raise RuntimeError(f"not starting {name}: stopping")
            process = self.spawn(name)
            self.processes[name] = process
        return process

    def _supervise(self, name: str) -> None:
        failures = 0
        started = time.monotonic()
        while not self.stopping.wait(POLL_S):
            process = self.processes[name]
            if process.poll() is None:
                continue
            ran_s = time.monotonic() - started
            failures = 1 if ran_s >= self.policy.stable_s else failures + 1
            status = describe_exit(process.returncode)
            if failures > self.policy.max_restarts:
                self.failure = (f"{name} ({status}) failed {failures} times in a row, each within "
                                f"{self.policy.stable_s:g} s of its start; giving up on it")
                logger.error("%s", self.failure)
                self.gave_up.set()
                return
            delay = self.policy.delay(failures)
            logger.warning("%s died (%s) after %.1f s; restarting it in %.1f s (attempt %d of %d)",
                           name, status, ran_s, delay, failures, self.policy.max_restarts)
            if self.stopping.wait(delay):
                return
            started = time.monotonic()
            try:
                process = self._spawn(name)
                self.wait_ready(name, process, self.stopping)
            except Exception as error:
                if self.stopping.is_set():
                    return
                # Not serving in time counts as a failure like any other: the next look finds it dead.
                logger.warning("%s did not come back: %s", name, error)
                _kill(process)
                continue
            # Logged before it is counted: whoever sees the count sees the log line too.
            logger.warning("%s restarted (pid %d) and serving again", name, process.pid)
            self.restarts[name] = self.restarts.get(name, 0) + 1

    def stop(self, timeout: float = 10.0, timeouts: dict[str, float] | None = None) -> None:
        """No more restarts; then the processes of each stage get SIGTERM together and are waited for, up to
        timeout seconds (or timeouts[name]), last stage first, so that no service is left calling one that
        has already stopped."""
        with self.lock:
            self.stopping.set()
        for thread in self.threads:
            thread.join()
        self.threads.clear()
        for stage in reversed(self.stages):
            processes = [(name, self.processes[name]) for name in stage if name in self.processes]
            for _name, process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            waits = [(timeouts or {}).get(name, timeout) for name, _process in processes]
            deadline = time.monotonic() + max(waits, default=0.0)
            for name, process in processes:
                try:
                    process.wait(timeout=max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in time; killing it", name)
                    _kill(process)
        self.stages.clear()
        self.processes.clear()


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
