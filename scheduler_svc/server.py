"""The scheduler service: frontends stream requests in, batched updates stream back out.

Each engine step makes exactly one Step call to the KV-cache service and one Execute call to the
executor, whatever the batch size. The engine loop only hands each step's outputs over; each frontend's
stream turns them into protobuf on its own thread, and when that frontend falls behind, the outputs of
several steps go out as one update (a request's tokens of those steps together).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

from pagedserve.convert import (
    block_step_request_to_proto,
    block_step_results_from_proto,
    execute_result_from_proto,
    execute_step_to_proto,
    sampling_from_proto,
    scheduler_update_to_proto,
)
from pagedserve.step import (
    BlockStepRequest,
    BlockStepResult,
    ExecuteResult,
    ExecuteStep,
    RequestOutput,
    merge_results,
)
from pagedserve.v1 import executor_pb2, kvcache_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.request import Request
from scheduler_svc.scheduler import BlockManagerUnavailable, ExecutorUnavailable, Scheduler, StepFailed
from scheduler_svc.stream_interval import StreamInterval

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0  # for the KV-cache service's stats: a metrics scrape must not hang on a service that is down
RPC_TIMEOUT_S = 600.0  # a step on a CPU with a long prefill can take a while; a hung peer must not hang us forever
EPOCH_TIMEOUT_S = 2.0
WATCH_EVERY_S = 1.0
DRAINING = "the scheduler is shutting down and takes no new requests; retry once another one serves"

# A step answered with this error did not run on this executor instance (it was planned for another one):
# its outcome is nothing, and nothing is wrong with its requests. Any other error is the executor raising.
_EXECUTOR_LOST = "FAILED_PRECONDITION"


class RemoteBackends:
    """The block manager's call and the executors' streams of steps, counted, with their failures told apart
    for the engine loop. With executor_stub the scheduler drives that one executor; without, the executors
    registered with the KV-cache service, each reached at the address it registered (open_executor opens a
    stub to it), a step going to them in parts, at once."""

    def __init__(self, kvcache_stub, executor_stub=None, open_executor: Callable[[str], object] | None = None) -> None:
        self.kvcache_stub = kvcache_stub
        self.executor_stub = executor_stub
        self.open_executor = open_executor
        self.executor_stubs: dict[str, object] = {}
        self.kv_rpcs = 0
        self.executor_rpcs = 0  # steps (parts of steps) sent
        self.streams: dict[str, _StepStream] = {}

    def allocate_blocks(self, request: BlockStepRequest) -> dict[str, BlockStepResult]:
        self.kv_rpcs += 1
        try:
            reply = self.kvcache_stub.Step(block_step_request_to_proto(request), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as error:
            raise BlockManagerUnavailable(f"{error.code().name}: {error.details()}") from None
        return block_step_results_from_proto(reply)

    def submit(self, step: ExecuteStep) -> "_PendingStep | _PendingParts":
        """Sends the step (each part to its executor) without waiting for it, on the executor's stream, opened
        again if it broke."""
        parts = step.parts or [step]
        pending = [self._stream(part.executor_id).send(part) for part in parts]
        self.executor_rpcs += len(pending)
        if self.executor_stub is not None:  # the one executor: followed through its epoch
            return pending[0]
        return _PendingParts(pending, [(part.executor_id, part.executor_epoch) for part in parts], self._lost)

    def _lost(self, address: str, epoch: str, reason: str) -> None:
        """A registered executor failed a step's RPC: the KV-cache service drops its pool (alive, it registers
        again), so that its requests, rolled back, are admitted elsewhere rather than routed to it again."""
        try:
            self.kvcache_stub.DropExecutor(kvcache_pb2.DropExecutorRequest(address=address, epoch=epoch,
                                                                           reason=reason), timeout=EPOCH_TIMEOUT_S)
        except grpc.RpcError:
            pass  # its heartbeats stop all the same, if it is gone

    def _stream(self, address: str) -> "_StepStream":
        stream = self.streams.get(address)
        if stream is None or stream.broken:
            stream = self.streams[address] = _StepStream(self._executor(address))
        return stream

    def _executor(self, address: str):
        if self.executor_stub is not None:  # the one executor, whatever the KV-cache service calls it
            return self.executor_stub
        if address not in self.executor_stubs:
            self.executor_stubs[address] = self.open_executor(address)
        return self.executor_stubs[address]

    def executor_epoch(self) -> str:
        """The executor instance now serving ("" for the executors registered with the KV-cache service, whose
        epochs come with each step's answer); raises ExecutorUnavailable while there is none."""
        try:
            if self.executor_stub is not None:
                return self.executor_stub.GetInfo(executor_pb2.ExecutorInfoRequest(), timeout=EPOCH_TIMEOUT_S).epoch
            registered = self.kvcache_stub.ListExecutors(kvcache_pb2.ListExecutorsRequest(), timeout=EPOCH_TIMEOUT_S)
        except grpc.RpcError as error:
            raise ExecutorUnavailable(f"{error.code().name}: {error.details()}") from None
        if not registered.executors:
            raise ExecutorUnavailable("no executor is registered with the KV-cache service")
        return ""


class _PendingParts:
    """A step's parts out on the registered executors: its result once all are back (each waited for, so that
    none is still running when the step is rolled back), the first failure if any failed. An executor that did
    not answer is reported lost (on_lost(address, epoch, reason))."""

    def __init__(self, parts: list["_PendingStep"], executors: list[tuple[str, str]],
                 on_lost: Callable[[str, str, str], None]) -> None:
        self.parts, self.executors, self.on_lost = parts, executors, on_lost

    def result(self) -> ExecuteResult:
        results, errors = [], []
        for part, (address, epoch) in zip(self.parts, self.executors):
            try:
                results.append(part.result())
            except ExecutorUnavailable as error:
                self.on_lost(address, epoch, str(error))
                errors.append(error)
            except StepFailed as error:
                errors.append(error)
        if errors:  # an executor lost makes the whole step's outcome unknown; else a part that raised fails it
            raise next((e for e in errors if isinstance(e, ExecutorUnavailable)), errors[0])
        return merge_results(results)


class _PendingStep:
    """A step sent and not answered yet; result() tells its failures apart for the engine loop."""

    def __init__(self, stream: "_StepStream", step_id: int) -> None:
        self.stream, self.step_id = stream, step_id
        self.sent_at = time.monotonic()
        self.answer: executor_pb2.ExecuteResult | ExecutorUnavailable | None = None

    def result(self) -> ExecuteResult:
        answer = self.stream.wait_for(self)
        if isinstance(answer, ExecutorUnavailable):
            raise answer
        if answer.HasField("error"):
            kind = ExecutorUnavailable if answer.error.code == _EXECUTOR_LOST else StepFailed
            raise kind(f"{answer.error.code}: {answer.error.message}")
        return execute_result_from_proto(answer)


class _StepStream:
    """One Execute stream: steps go out as they are planned, answers come back in the same order. Only the
    engine loop's thread uses it. When it breaks (the executor died), or an answer is overdue (a hung
    executor), every step still unanswered is in doubt: ExecutorUnavailable, and the next step opens a new
    stream."""

    def __init__(self, executor_stub) -> None:
        self.outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.answers = executor_stub.Execute(iter(self.outgoing.get, None))
        self.unanswered: deque[_PendingStep] = deque()
        self.broken = False
        self.closed = threading.Event()
        threading.Thread(target=self._watch, name="step-stream-watch", daemon=True).start()

    def send(self, step: ExecuteStep) -> _PendingStep:
        pending = _PendingStep(self, step.step_id)
        self.unanswered.append(pending)
        self.outgoing.put(execute_step_to_proto(step))
        return pending

    def wait_for(self, pending: _PendingStep):
        """The pending step's answer: the answers of the steps sent before it are taken first, in order."""
        while pending.answer is None:
            # The step waited for stays listed until its answer comes, so that the watchdog sees it overdue
            # (the last step out too).
            oldest = self.unanswered[0]
            try:
                answer = next(self.answers)
            except grpc.RpcError as error:
                self._break(f"{error.code().name}: {error.details()}")
                continue
            except StopIteration:
                self._break("the executor ended the stream")
                continue
            if answer.step_id != oldest.step_id:
                self._break(f"step {oldest.step_id} was answered as step {answer.step_id}")
                continue
            self.unanswered.popleft()
            oldest.answer = answer
        return pending.answer

    def _break(self, reason: str) -> None:
        for pending in self.unanswered:
            pending.answer = ExecutorUnavailable(reason)
        self.unanswered.clear()
        self.broken = True
        self.closed.set()
        self.outgoing.put(None)
        self.answers.cancel()

    def _watch(self) -> None:
        """Cancels the stream (so that the engine loop's wait ends) when the oldest step is overdue."""
        while not self.closed.wait(WATCH_EVERY_S):
            unanswered = list(self.unanswered)
            if unanswered and time.monotonic() - unanswered[0].sent_at > RPC_TIMEOUT_S:
                self.answers.cancel()
                return


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
        self.stream_interval = StreamInterval(scheduler.config.stream_interval)
        self.loop = EngineLoop(scheduler, backends.submit, self._publish, backends.executor_epoch,
                               async_scheduling=scheduler.config.async_scheduling)

    def Connect(self, request_iterator, context):
        connection = _Connection()
        reader = threading.Thread(target=self._read, args=(request_iterator, connection), daemon=True)
        reader.start()
        while True:
            outputs = connection.outbox.get()
            if outputs is None:
                return
            # Whatever else has come meanwhile goes out in the same update.
            closed = False
            while not closed:
                try:
                    more = connection.outbox.get_nowait()
                except queue.Empty:
                    break
                closed = more is None
                outputs += more or []
            yield scheduler_update_to_proto(outputs)
            if closed:
                return

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
            connection.outbox.put([RequestOutput(add.request_id, [], finish_reason="error", error=str(error))])
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
            connection.outbox.put([refusal])
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
        """Hands each frontend its requests' outputs (its stream converts and sends them)."""
        by_connection: dict[_Connection, list[RequestOutput]] = {}
        with self.owners_lock:
            for output in self.stream_interval.release(outputs):
                connection = self.owners.get(output.request_id)
                if connection is None:
                    continue
                if output.finish_reason is not None:
                    del self.owners[output.request_id]
                    connection.request_ids.discard(output.request_id)
                items = by_connection.get(connection)
                if items is None:
                    items = by_connection[connection] = []
                items.append(output)
        for connection, items in by_connection.items():
            connection.outbox.put(items)

    def GetStats(self, request, context):
        stats = scheduler_pb2.SchedulerStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_steps=self.loop.num_steps, num_preemptions=self.scheduler.num_preemptions,
            kv_rpcs=self.backends.kv_rpcs, kv_calls_skipped=self.scheduler.num_calls_skipped,
            executor_rpcs=self.backends.executor_rpcs,
            num_failed_steps=self.loop.num_failed_steps, num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
            steps_out_limit=self.loop.steps_out_limit(), loop_work_share=self.loop.work_share,
        )
        if request.include_kv_cache:
            try:
                stats.kv_cache.CopyFrom(self.backends.kvcache_stub.GetStats(kvcache_pb2.KVCacheStatsRequest(),
                                                                            timeout=STATS_TIMEOUT_S))
            except grpc.RpcError as error:
                logger.debug("KV-cache stats unavailable: %s", error.code())
        return stats

    def GetInfo(self, request, context):
        return self.info

