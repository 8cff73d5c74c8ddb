"""The public Generate API: validate, tokenize, stream from the scheduler, turn tokens into text.

All of this frontend's requests share one stream to the scheduler; each step's batched update is fanned
out to the waiting client streams here.
"""
from __future__ import annotations

import logging
import queue
import threading
import uuid

import grpc

from frontend.validation import GenerateInput, ValidationError, validate_and_tokenize
from pagedserve.convert import FINISH_REASON_NAMES, FINISH_REASONS, sampling_to_proto
from pagedserve.output import RequestOutputState
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2

logger = logging.getLogger(__name__)

# How often a waiting stream checks that its client is still there (cancellation also arrives as a callback).
POLL_S = 1.0


class SchedulerLink:
    """The frontend's one stream to the scheduler: requests go out, each output goes to its request's queue."""

    def __init__(self, scheduler_stub) -> None:
        self.scheduler = scheduler_stub
        self.pending: dict[str, queue.SimpleQueue] = {}
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.closing = False
        self._connect()

    def _connect(self) -> None:
        # wait_for_ready: a scheduler that is restarting is waited for rather than failed at once.
        self.outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.stream = self.scheduler.Connect(self._outgoing_messages(self.outgoing), wait_for_ready=True)
        self.broken = None
        threading.Thread(target=self._read, args=(self.stream,), name="scheduler-link", daemon=True).start()

    @staticmethod
    def _outgoing_messages(outgoing: queue.SimpleQueue):
        while True:
            message = outgoing.get()
            if message is None:
                return
            yield message

    def _read(self, stream) -> None:
        try:
            for update in stream:
                with self.lock:
                    routes = [(self.pending.get(o.request_id), o) for o in update.outputs]
                for inbox, output in routes:
                    if inbox is not None:
                        inbox.put(output)
            reason = "the scheduler closed the stream"
        except grpc.RpcError as error:
            reason = f"lost the scheduler: {error.code().name}"
        if not self.closing:
            logger.warning("%s", reason)
        with self.lock:
            self.broken = reason
            inboxes = list(self.pending.values())
        for inbox in inboxes:
            inbox.put(None)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               cache_salt: str | None) -> queue.SimpleQueue:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        with self.lock:
            if self.closing:
                raise ConnectionError("the frontend is shutting down")
            if self.broken:
                # Requests of the lost stream have failed; new ones go out on a fresh stream.
                self._connect()
            if request_id in self.pending:
                raise KeyError(request_id)
            self.pending[request_id] = inbox
        add = scheduler_pb2.AddRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, cache_salt=cache_salt or ""
        )
        sampling_to_proto(params, add.sampling)
        self.outgoing.put(scheduler_pb2.SchedulerRequest(add=add))
        return inbox

    def abort(self, request_id: str) -> None:
        self.outgoing.put(scheduler_pb2.SchedulerRequest(abort=scheduler_pb2.AbortRequest(request_id=request_id)))

    def release(self, request_id: str) -> None:
        with self.lock:
            self.pending.pop(request_id, None)

    def close(self) -> None:
        self.closing = True
        self.outgoing.put(None)
        self.stream.cancel()


def _generate_input(request: generate_pb2.GenerateRequest) -> GenerateInput:
    sampling = request.sampling
    inp = GenerateInput(
        request_id=request.request_id or uuid.uuid4().hex,
        min_tokens=sampling.min_tokens,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        cache_salt=request.cache_salt or None,
    )
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "skip_special_tokens"):
        if sampling.HasField(name):
            setattr(inp, name, getattr(sampling, name))
    which = request.WhichOneof("input")
    if which == "prompt":
        inp.prompt = request.prompt
    elif which == "prompt_token_ids":
        inp.prompt_token_ids = list(request.prompt_token_ids.ids)
    elif which == "messages":
        inp.messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    return inp


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, link: SchedulerLink, tokenizer, info: scheduler_pb2.SchedulerInfo,
                 max_prompt_chars: int) -> None:
        self.link = link
        self.tokenizer = tokenizer
        self.info = info
        self.max_prompt_chars = max_prompt_chars
        # Client request ids in flight here. The scheduler sees a fresh id per submission instead: it frees
        # an id a step after the request ends, and a client may reuse its own the moment its stream ends.
        self.in_flight: set[str] = set()
        self.in_flight_lock = threading.Lock()

    def GetModelInfo(self, request, context):
        return generate_pb2.ModelInfo(
            model=self.info.model, max_model_len=self.info.max_model_len, vocab_size=self.info.vocab_size
        )

    def Generate(self, request, context):
        inp = _generate_input(request)
        try:
            prompt_ids, params = validate_and_tokenize(
                inp, self.tokenizer, self.info.max_model_len, self.info.vocab_size,
                max_prompt_chars=self.max_prompt_chars,
            )
        except ValidationError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        request_id = inp.request_id
        with self.in_flight_lock:
            duplicate = request_id in self.in_flight
            self.in_flight.add(request_id)
        if duplicate:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")
        internal_id = uuid.uuid4().hex
        try:
            try:
                inbox = self.link.submit(internal_id, prompt_ids, params, inp.cache_salt)
            except ConnectionError as error:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
            # Whatever ends the call (a client cancel, a deadline, the end of the stream), the scheduler is
            # told; aborting a finished request is a no-op there.
            context.add_callback(lambda: self.link.abort(internal_id))
            try:
                state = RequestOutputState(self.tokenizer, prompt_ids, params)
                yield from self._stream(request_id, internal_id, state, inbox, context)
            finally:
                self.link.release(internal_id)
        finally:
            with self.in_flight_lock:
                self.in_flight.discard(request_id)

    def _stream(self, request_id, internal_id, state: RequestOutputState, inbox, context):
        while True:
            try:
                output = inbox.get(timeout=POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if output is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, self.link.broken or "scheduler unavailable")
            if output.finish_reason == common_pb2.FINISH_REASON_OVERLOADED:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, output.error or "the server is overloaded")
            if output.finish_reason == common_pb2.FINISH_REASON_ERROR:
                context.abort(grpc.StatusCode.INTERNAL, output.error or "request failed")
            delta = state.update(list(output.new_token_ids), FINISH_REASON_NAMES[output.finish_reason])
            if delta.abort:
                self.link.abort(internal_id)
            response = generate_pb2.GenerateResponse(
                request_id=request_id, token_ids=output.new_token_ids, text=delta.text, logprobs=output.logprobs,
            )
            if delta.finished:
                response.finish_reason = FINISH_REASONS[delta.finish_reason]
                response.usage.prompt_tokens = delta.usage.prompt_tokens
                response.usage.completion_tokens = delta.usage.completion_tokens
            yield response
            if delta.finished:
                return
