"""The scheduler's busy loop: engine steps on one thread, requests coming in from any other.

Adds and aborts are queued and applied between steps, so the scheduler core is only ever touched by the
loop's thread. A step runs whenever a request is unfinished or finished requests still hold blocks.

Steps are planned ahead (async_scheduling): while the executor runs step N, the loop has already planned
step N+1 with the block manager and sent it, so the executor finds it waiting when N is done and never
waits on the scheduler. Then it applies N's result (new tokens, stop conditions), publishes it, and plans
N+2. So two steps are out, and every plan is made knowing the result of all but the last step sent.
When the loop's own work (applying, publishing, planning with the block manager) takes most of the
executor's step (a fast executor, hundreds of running requests, a busy machine), two are not enough: a
plan that comes late leaves the executor idle. The loop then goes three steps out, and back to two once
its work is a small part of the step again; it measures both as it goes. Three steps out costs a new
request one more step before its first, so it is not the rule. While three out, the loop also has the block
manager reserve slots ahead (see Scheduler.reserve_ahead), so that most steps of a steady decode are
planned without calling it: that call is the largest part of the loop's work. Without async_scheduling, or while a
suspect runs alone or a peer is down, one step is out at a time. The executor runs steps in the order
they were planned (each names the one it follows).

When a peer fails, the loop recovers without losing a request and without spinning: a block manager that
does not answer is retried with backoff (nothing was planned); an executor that does not answer has the
steps out rolled back, and the loop waits, with backoff, until an executor answers again, re-running every
request from its tokens so far if it is a new instance; a step the executor raised on is rolled back (with
the steps sent after it) and retried without the request that caused it (see Scheduler.steps_failed). One
warning per outage.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pagedserve.step import ExecuteResult, ExecuteStep, RequestOutput
from scheduler_svc.request import Request
from scheduler_svc.scheduler import BlockManagerUnavailable, ExecutorUnavailable, Scheduler, StepFailed

logger = logging.getLogger(__name__)

FIRST_RETRY_S = 0.05
MAX_RETRY_S = 2.0
# The share of the time between two results that the loop spends working (not waiting for the executor)
# above which it goes three steps out, and below which it comes back to two; and the weight of the latest
# cycle in the running average of that share.
DEEPER_ABOVE, SHALLOWER_BELOW = 0.6, 0.4
WORK_SHARE_WEIGHT = 0.1


class PendingResult(Protocol):
    def result(self) -> ExecuteResult:
        """Waits for the step's result; raises ExecutorUnavailable or StepFailed."""


class CompletedCall:
    """An executor in this process: the step runs when it is sent, and result() hands over its outcome."""

    def __init__(self, execute: Callable[[ExecuteStep], ExecuteResult], step: ExecuteStep) -> None:
        self.error: ExecutorUnavailable | StepFailed | None = None
        try:
            self.value = execute(step)
        except (ExecutorUnavailable, StepFailed) as error:
            self.error = error

    def result(self) -> ExecuteResult:
        if self.error is not None:
            raise self.error
        return self.value


@dataclass(slots=True)
class InFlightStep:
    """A step sent to the executor whose result has not been applied. (Spread over several executors, call
    holds one pending call per executor, all of which must come back: see scheduler_svc/server.py.)"""

    step: ExecuteStep
    call: PendingResult


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        submit: Callable[[ExecuteStep], PendingResult],
        publish: Callable[[list[RequestOutput]], None],
        executor_epoch: Callable[[], str],
        async_scheduling: bool = True,
        steps_ahead: int | None = None,
    ) -> None:
        """submit: sends a step to the executor without waiting for its result. steps_ahead: how many steps
        may be out with async_scheduling (None: two or three, as measured; see the module's docstring)."""
        if steps_ahead is not None and steps_ahead < 1:
            raise ValueError(f"steps_ahead must be at least 1, got {steps_ahead}")
        self.scheduler = scheduler
        self.submit = submit
        self.publish = publish
        self.executor_epoch = executor_epoch
        self.async_scheduling = async_scheduling
        self.in_flight: deque[InFlightStep] = deque()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.num_steps = 0
        self.num_failed_steps = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # While a peer is down: which one, since when, and how long to wait before the next try.
        self.outage: str | None = None
        self.outage_since = 0.0
        self.retry_delay = 0.0
        self.executor_lost = False
        self.steps_ahead = steps_ahead
        # The running average of the share of the loop's time spent working, and when the last result came
        # (None while the pipeline is empty: the time until the next one is not the loop's work).
        self.work_share = 0.0
        self.deep = False
        self.last_result_at: float | None = None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.inbox.put(None)
        self.thread.join(timeout=10)

    def add(self, request: Request) -> None:
        self.inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def has_work(self) -> bool:
        return bool(self.in_flight) or self._has_work_to_plan()

    def _has_work_to_plan(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.pending_frees)

    def _run(self) -> None:
        while not self.stopped.is_set():
            outputs: list[RequestOutput] = []
            # Block for input only when idle; otherwise take what has arrived (waiting out a retry delay)
            # and step.
            command = self._poll(self.retry_delay) if self.has_work() else self.inbox.get()
            while command is not None:
                outputs.extend(self._apply(command))
                command = self._poll()
            if self.stopped.is_set():
                break
            if self.has_work():
                try:
                    outputs.extend(self.step())
                except Exception:  # a bug of ours: state is in doubt, so fail what is in flight, loudly
                    logger.exception("engine step failed; failing every unfinished request")
                    self.in_flight.clear()
                    self.scheduler.planned_requests.clear()
                    outputs.extend(self._fail_all("engine step failed"))
            if outputs:
                self.publish(outputs)

    def steps_out_limit(self) -> int:
        """How many steps may be out at once, now."""
        if not self.async_scheduling or self.scheduler.suspects or self.outage is not None:
            return 1
        if self.steps_ahead is not None:
            return self.steps_ahead
        return 3 if self.deep else 2

    def step(self) -> list[RequestOutput]:
        """Plans and sends steps while the pipeline has room, then applies the oldest one's result."""
        self.scheduler.reserve_ahead = self.steps_out_limit() >= 3
        while len(self.in_flight) < self.steps_out_limit() and self._has_work_to_plan() and self._send_next():
            pass
        return self._apply_oldest() if self.in_flight else []

    def _send_next(self) -> bool:
        """Plans the next step and sends it; False when a peer did not answer (nothing was sent)."""
        try:
            if self.executor_lost:
                epoch = self.executor_epoch()
                if epoch != self.scheduler.executor_epoch:
                    logger.warning("a new executor instance serves: re-running %d requests from their tokens so far",
                                   len(self.scheduler.running))
                    self.scheduler.executor_replaced(epoch)
                self.executor_lost = False
            step = self.scheduler.schedule()
        except (BlockManagerUnavailable, ExecutorUnavailable) as error:
            self._down("the KV-cache service" if isinstance(error, BlockManagerUnavailable) else "the executor", error)
            return False
        self.in_flight.append(InFlightStep(step, self.submit(step)))
        return True

    def _apply_oldest(self) -> list[RequestOutput]:
        oldest = self.in_flight[0]
        waited_from = time.perf_counter()
        try:
            result = oldest.call.result()
        except (ExecutorUnavailable, StepFailed) as error:
            self.last_result_at = None
            return self._roll_back(error)
        self._measure(waited_from)
        self.in_flight.popleft()
        self._up()
        self.num_steps += 1
        return self.scheduler.update(oldest.step, result)

    def _measure(self, waited_from: float) -> None:
        """Folds the cycle that ends with this result into the running share of the loop's work."""
        now = time.perf_counter()
        # Calls to the block manager skipped meanwhile count as the work they would have been, so that the
        # reservations that let the loop skip them do not switch themselves off.
        skipped, self.scheduler.call_seconds_skipped = self.scheduler.call_seconds_skipped, 0.0
        if self.last_result_at is not None and now > self.last_result_at:
            work = (waited_from - self.last_result_at + skipped) / (now - self.last_result_at)
            self.work_share += WORK_SHARE_WEIGHT * (work - self.work_share)
            if self.work_share > DEEPER_ABOVE:
                self.deep = True
            elif self.work_share < SHALLOWER_BELOW:
                self.deep = False
        self.last_result_at = now if len(self.in_flight) > 1 else None

    def _roll_back(self, error: ExecutorUnavailable | StepFailed) -> list[RequestOutput]:
        """The oldest step out failed: it and every step sent after it are rolled back."""
        steps = list(self.in_flight)
        self.in_flight.clear()
        for later in steps[1:]:  # waited for, so that none of it is still running when the next plan goes out
            try:
                later.call.result()
            except (ExecutorUnavailable, StepFailed):
                pass
        self.num_failed_steps += len(steps)
        failed = [s.step for s in steps]
        if isinstance(error, ExecutorUnavailable):
            self.executor_lost = True
            self._down("the executor", error)
            return self.scheduler.steps_failed(failed, None)
        logger.warning("the executor failed a step of %d requests (%s); retrying without the cause",
                       len(failed[0].requests), error)
        return self.scheduler.steps_failed(failed, str(error))

    def _down(self, peer: str, error: Exception) -> None:
        if self.outage is None:
            logger.warning("%s is unavailable (%s); retrying with backoff", peer, error)
            self.outage, self.outage_since = peer, time.monotonic()
        self.retry_delay = min(max(self.retry_delay * 2, FIRST_RETRY_S), MAX_RETRY_S)

    def _up(self) -> None:
        if self.outage is not None:
            logger.warning("%s is back after %.1f s", self.outage, time.monotonic() - self.outage_since)
        self.outage, self.retry_delay = None, 0.0

    def _poll(self, timeout: float = 0.0):
        try:
            return self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, command) -> list[RequestOutput]:
        kind, payload = command
        if kind == "add":
            if len(self.scheduler.waiting) >= self.scheduler.config.max_waiting:
                return [RequestOutput(payload.request_id, [], finish_reason="overloaded",
                                      error=f"{len(self.scheduler.waiting)} requests are already waiting "
                                            f"(max_waiting {self.scheduler.config.max_waiting}); try again later")]
            try:
                self.scheduler.add_request(payload)
            except ValueError as error:
                return [RequestOutput(payload.request_id, [], finish_reason="error", error=str(error))]
            return []
        output = self.scheduler.abort_request(payload)
        return [output] if output is not None else []

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self.scheduler.requests):
            output = self.scheduler.abort_request(request_id)
            output.finish_reason, output.error = "error", reason
            outputs.append(output)
        return outputs
