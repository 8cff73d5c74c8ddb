"""The executor service: steps come in on a stream per scheduler and run one at a time, in order."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from executor_svc.model_runner import LaunchedStep, ModelRunner, StaleEpoch
from executor_svc.offload import HostTier, RedisTier
from pagedserve.convert import execute_result_to_proto, execute_step_from_proto
from pagedserve.step import ExecuteStep
from pagedserve.v1 import executor_pb2, executor_pb2_grpc, kvcache_pb2

logger = logging.getLogger(__name__)


class MalformedStep(Exception):
    """A step whose message does not make sense (e.g. decode rows whose arrays do not line up)."""


class StepWorker:
    """Runs submitted steps, one at a time and in the order submitted, on the thread that calls run().

    torch's OpenMP pool belongs to the thread that uses it: steps on gRPC's worker threads would each
    bring up a pool of their own beside the one that loaded the model, and the pools' waiting threads
    would fight over the cores. So the process's main thread runs every step.

    A submitted function launches its step (ModelRunner.launch). While a launched step still occupies the
    device, the next step, if it has come, is launched behind it before the first one's result is handed
    over, so that the host's work for a step overlaps the device's work for the one before.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn: Callable[[ExecuteStep], LaunchedStep], step: ExecuteStep) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn, step))
        return future

    def run(self, stopping: threading.Event) -> None:
        on_device: tuple[Future, LaunchedStep] | None = None
        while not stopping.is_set():
            if on_device is not None and on_device[1].ready_at <= time.monotonic():
                self._hand_over(*on_device)
                on_device = None
            wait_s = 0.2 if on_device is None else max(on_device[1].ready_at - time.monotonic(), 0)
            try:
                job = self.jobs.get(timeout=wait_s)
            except queue.Empty:
                job = None
            launched = self._launch(*job) if job is not None else None
            if on_device is not None:
                self._hand_over(*on_device)
            on_device = launched
        if on_device is not None:
            self._hand_over(*on_device)

    @staticmethod
    def _launch(future: Future, fn: Callable[[ExecuteStep], LaunchedStep],
                step: ExecuteStep) -> tuple[Future, LaunchedStep] | None:
        if not future.set_running_or_notify_cancel():
            return None
        try:
            return future, fn(step)
        except BaseException as error:  # handed to the stream, which reports it
            future.set_exception(error)
            return None

    @staticmethod
    def _hand_over(future: Future, launched: LaunchedStep) -> None:
        try:
            future.set_result(launched.result())
        except BaseException as error:
            future.set_exception(error)


def executor_info(runner: ModelRunner) -> executor_pb2.ExecutorInfo:
    """What the executor tells the other services (GetInfo); the offline LLM builds its cores from it too."""
    tier = runner.offload_tier
    return executor_pb2.ExecutorInfo(
        model=runner.model_config.model, model_dir=str(runner.model_dir), model_id=runner.model_id,
        num_blocks=runner.num_blocks, block_bytes=runner.block_bytes,
        block_size=runner.block_size, max_model_len=runner.max_model_len,
        vocab_size=runner.config.vocab_size, eos_token_ids=list(runner.eos_token_ids),
        attention_backend=runner.attention_backend_name, device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."), kv_cache_dtype=str(runner.kv_dtype).removeprefix("torch."),
        num_prefill_tokens=runner.num_prefill_tokens, num_decode_tokens=runner.num_decode_tokens,
        offload=tier.name if tier else "none", blocks_saved=runner.blocks_saved,
        blocks_loaded=runner.blocks_loaded, failed_loads=runner.failed_loads,
        bytes_moved=runner.bytes_saved + runner.bytes_loaded, tier_errors=tier.errors if tier else 0,
        offload_capacity_blocks=tier.capacity_bytes // runner.block_bytes if isinstance(tier, HostTier) else 0,
        offload_redis_url=tier.url if isinstance(tier, RedisTier) else "", epoch=runner.epoch,
        swap_capacity_blocks=runner.swap_space.capacity_bytes // runner.block_bytes if runner.swap_space else 0,
        prefill_tokens_per_s=runner.prefill_tokens_per_s, copy_bytes_per_s=runner.copy_bytes_per_s,
    )


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # Steps run one at a time on the thread that loaded the model (see StepWorker).
        self.worker = StepWorker()

    def Execute(self, request_iterator, context):
        """A scheduler's stream of steps: each is parsed as it arrives and queued to run, so that the next
        step is waiting when one ends; the answers go back in the same order."""
        answers: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._receive, args=(request_iterator, answers), name="execute-receive",
                         daemon=True).start()
        while True:
            pending = answers.get()
            if pending is None:
                return
            yield self._answer(*pending)

    def _receive(self, request_iterator, answers: queue.SimpleQueue) -> None:
        try:
            for message in request_iterator:
                try:
                    step, rejected = execute_step_from_proto(message)
                except ValueError as error:
                    malformed: Future = Future()
                    malformed.set_exception(MalformedStep(str(error)))
                    answers.put((message.step_id, malformed, {}))
                    continue
                answers.put((step.step_id, self.worker.submit(self.runner.launch, step), rejected))
        except Exception as error:  # the scheduler went away: its stream ends with an error or cancel
            logger.info("step stream closed: %s", error)
        finally:
            answers.put(None)

    @staticmethod
    def _answer(step_id: int, running: Future, rejected: dict[str, str]) -> executor_pb2.ExecuteResult:
        """The step's result (with the requests set aside while parsing it among the rejected), or why it
        did not run."""
        try:
            result = running.result()
            result.rejected.update(rejected)
            answer = execute_result_to_proto(result)
        except StaleEpoch as error:
            answer = _step_error("FAILED_PRECONDITION", str(error))
        except MalformedStep as error:
            answer = _step_error("INVALID_ARGUMENT", str(error))
        except Exception as error:  # the scheduler rolls the step back; the cause belongs in this log
            logger.exception("step failed")
            answer = _step_error("INTERNAL", f"{type(error).__name__}: {error}")
        answer.step_id = step_id
        return answer

    def GetInfo(self, request, context):
        return executor_info(self.runner)


def _step_error(code: str, message: str) -> executor_pb2.ExecuteResult:
    return executor_pb2.ExecuteResult(error=executor_pb2.StepError(code=code, message=message))


class KVCacheRegistration:
    """Registers the executor with the KV-cache service and renews the registration by heartbeat, on a thread
    of its own, until stopped. A refusal (another model or block size than the executors already registered)
    is final: refused says why, and on_refused is called."""

    def __init__(self, stub, address: str, info: Callable[[], executor_pb2.ExecutorInfo],
                 on_refused: Callable[[], None], first_interval_s: float = 1.0) -> None:
        self.stub, self.address, self.info, self.on_refused = stub, address, info, on_refused
        self.interval_s = first_interval_s
        self.refused: str | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvcache-heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        registered = False
        while not self.stopping.is_set():
            try:
                reply = self.stub.RegisterExecutor(
                    kvcache_pb2.ExecutorRegistration(address=self.address, info=self.info()),
                    timeout=max(self.interval_s, 1.0))
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.refused = error.details()
                    logger.error("the KV-cache service refused this executor: %s", self.refused)
                    self.on_refused()
                    return
                if registered:
                    logger.warning("heartbeat to the KV-cache service failed (%s); retrying", error.code().name)
                registered = False
            else:
                if not registered or reply.new_pool:
                    logger.info("registered with the KV-cache service as %s (a new pool: %s)", self.address,
                                reply.new_pool)
                registered = True
                # Three beats within the service's time to live, so that one lost beat drops nothing.
                self.interval_s = reply.heartbeat_ttl_s / 3
            self.stopping.wait(self.interval_s)
