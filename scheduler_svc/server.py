"""The scheduler service: frontends stream requests in, one batched update per step streams back out.

Each engine step makes exactly one Step call to the KV-cache service and one Execute call to the
executor, whatever the batch size.
"""
from __future__ import annotations

import logging
import queue
import threading

import grpc

from pagedserve.convert import (
    block_step_request_to_proto,
    block_step_result_from_proto,
    execute_result_from_proto,
    execute_step_to_proto,
    request_output_to_proto,
    sampling_from_proto,
)
from pagedserve.step import BlockStepRequest, BlockStepResult, ExecuteResult, ExecuteStep, RequestOutput
from pagedserve.v1 import executor_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.request import Request
from scheduler_svc.scheduler import BlockManagerUnavailable, ExecutorUnavailable, Scheduler, StepFailed

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 600.0  # a step on a CPU with a long prefill can take a while; a hung peer must not hang us forever


# An executor that answers these did not run the step (or is gone): the step's outcome is unknown, and
# nothing is wrong with its requests. Any other error is the executor raising on the step.
_EXECUTOR_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                  grpc.StatusCode.FAILED_PRECONDITION}
EPOCH_TIMEOUT_S = 2.0
DRAINING = "the scheduler is shutting down and takes no new requests; retry once another one serves"


class RemoteBackends:
    """The two per-step calls, counted, with their failures told apart for the engine loop."""

    def __init__(self, kvcache_stub, executor_stub) -> None:
        self.kvcache_stub = kvcache_stub
        self.executor_stub = executor_stub
        self.kv_rpcs = 0
        self.executor_rpcs = 0

    def allocate_blocks(self, request: BlockStepRequest) -> BlockStepResult:
        self.kv_rpcs += 1
        try:
            reply = self.kvcache_stub.Step(block_step_request_to_proto(request), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as error:
            raise BlockManagerUnavailable(f"{error.code().name}: {error.details()}") from None
        return block_step_result_from_proto(reply)

    def execute(self, step: ExecuteStep) -> ExecuteResult:
        self.executor_rpcs += 1
        try:
            reply = self.executor_stub.Execute(execute_step_to_proto(step), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as error:
            kind = ExecutorUnavailable if error.code() in _EXECUTOR_LOST else StepFailed
            raise kind(f"{error.code().name}: {error.details()}") from None
        return execute_result_from_proto(reply)

    def executor_epoch(self) -> str:
        """The executor instance now serving; raises ExecutorUnavailable while there is none."""
        try:
            return self.executor_stub.GetInfo(executor_pb2.ExecutorInfoRequest(), timeout=EPOCH_TIMEOUT_S).epoch
        except grpc.RpcError as error:
            raise ExecutorUnavailable(f"{error.code().name}: {error.details()}") from None


class _Connection:
    """One frontend's stream: its outgoing updates and the requests it owns."""

    def __init__(self) -> None:
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.request_ids: set[str] = set()


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Any number of frontends connect, each with one stream; a request's outputs go back on the stream that
    submitted it, and a stream that ends takes its requests with it (aborted, their blocks freed).

    Draining (SIGTERM), it refuses new requests (finish reason "unavailable") and runs those it has."""

    def __init__(self, scheduler: Scheduler, backends: RemoteBackends, eos_token_ids: tuple[int, ...],
                 info: scheduler_pb2.SchedulerInfo) -> None:
        self.scheduler = scheduler
        self.backends = backends
        self.eos_token_ids = eos_token_ids
        self.info = info
        self.owners: dict[str, _Connection] = {}
        self.owners_lock = threading.Lock()
        self.draining = False
        self.loop = EngineLoop(scheduler, backends.execute, self._publish, backends.executor_epoch)

    def Connect(self, request_iterator, context):
        connection = _Connection()
        reader = threading.Thread(target=self._read, args=(request_iterator, connection), daemon=True)
        reader.start()
        while True:
            update = connection.outbox.get()
            if update is None:
                return
            yield update

    def _read(self, request_iterator, connection: _Connection) -> None:
        try:
            for message in request_iterator:
                if message.HasField("add"):
                    self._add(message.add, connection)
                else:
                    self.loop.abort(message.abort.request_id)
        except Exception as error:  # the frontend went away: its stream ends with an error or cancel
            logger.info("frontend stream closed: %s", error)
        finally:
            # A frontend that leaves takes its requests with it: nobody is left to read their tokens.
            with self.owners_lock:
                orphans = list(connection.request_ids)
            for request_id in orphans:
                self.loop.abort(request_id)
            connection.outbox.put(None)

    def _add(self, add: scheduler_pb2.AddRequest, connection: _Connection) -> None:
        try:
            params = sampling_from_proto(add.sampling, default_max_tokens=None)
            request = Request(
                add.request_id, list(add.prompt_token_ids), params, self.eos_token_ids,
                self.scheduler.config.max_model_len, cache_salt=add.cache_salt or None,
                output_token_ids=list(add.output_token_ids), priority=add.priority,
            )
        except ValueError as error:
            self._send(connection, [RequestOutput(add.request_id, [], finish_reason="error", error=str(error))])
            return
        with self.owners_lock:
            refusal = None
            if self.draining:
                refusal = RequestOutput(add.request_id, [], finish_reason="unavailable", error=DRAINING)
            elif add.request_id in self.owners:
                refusal = RequestOutput(add.request_id, [], finish_reason="error",
                                        error=f"request_id {add.request_id!r} is already in use")
            else:
                self.owners[add.request_id] = connection
                connection.request_ids.add(add.request_id)
        if refusal is not None:
            self._send(connection, [refusal])
            return
        self.loop.add(request)

    def start_draining(self) -> None:
        with self.owners_lock:
            self.draining = True

    def idle(self) -> bool:
        """Every request has finished and its blocks are freed (a step after it ends)."""
        with self.owners_lock:
            if self.owners:
                return False
        return not self.scheduler.has_unfinished_requests() and not self.scheduler.pending_frees

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_connection: dict[int, tuple[_Connection, list[RequestOutput]]] = {}
        with self.owners_lock:
            for output in outputs:
                connection = self.owners.get(output.request_id)
                if connection is None:
                    continue
                if output.finished:
                    del self.owners[output.request_id]
                    connection.request_ids.discard(output.request_id)
                by_connection.setdefault(id(connection), (connection, []))[1].append(output)
        for connection, items in by_connection.values():
            self._send(connection, items)

    @staticmethod
    def _send(connection: _Connection, outputs: list[RequestOutput]) -> None:
        update = scheduler_pb2.SchedulerUpdate()
        for output in outputs:
            request_output_to_proto(output, update.outputs.add())
        connection.outbox.put(update)

    def GetStats(self, request, context):
        return scheduler_pb2.SchedulerStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_steps=self.loop.num_steps, num_preemptions=self.scheduler.num_preemptions,
            kv_rpcs=self.backends.kv_rpcs, executor_rpcs=self.backends.executor_rpcs,
            num_failed_steps=self.loop.num_failed_steps, num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
        )

    def GetInfo(self, request, context):
        return self.info
