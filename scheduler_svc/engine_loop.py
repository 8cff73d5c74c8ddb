"""The scheduler's busy loop: engine steps on one thread, requests coming in from any other.

Adds and aborts are queued and applied between steps, so the scheduler core is only ever touched by the
loop's thread. A step runs whenever a request is unfinished or finished requests still hold blocks.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from pagedserve.step import ExecuteResult, ExecuteStep, RequestOutput
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        execute: Callable[[ExecuteStep], ExecuteResult],
        publish: Callable[[list[RequestOutput]], None],
    ) -> None:
        self.scheduler = scheduler
        self.execute = execute
        self.publish = publish
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.num_steps = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

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

    def _has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.pending_frees)

    def _run(self) -> None:
        while not self.stopped.is_set():
            outputs: list[RequestOutput] = []
            # Block for input only when idle; otherwise take what has arrived and step.
            command = self.inbox.get() if not self._has_work() else self._poll()
            while command is not None:
                outputs.extend(self._apply(command))
                command = self._poll()
            if self.stopped.is_set():
                break
            if self._has_work():
                try:
                    outputs.extend(self.scheduler.step(self.execute))
                    self.num_steps += 1
                except Exception:  # a failed step must not end the loop: fail its requests instead
                    logger.exception("engine step failed; failing every unfinished request")
                    outputs.extend(self._fail_all("engine step failed"))
            if outputs:
                self.publish(outputs)

    def _poll(self):
        try:
            return self.inbox.get_nowait()
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
