"""The public Generate API: validate, tokenize, stream from the scheduler, turn tokens into text.

All of this frontend's requests share one stream to the scheduler, read on the link's thread; each step's
batched update is fanned out from there to the client streams, all served on one event loop.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format

from frontend.generation import DRAINING, AsyncInbox, GenerateCall, GenerateError, with_the_rest
from frontend.metrics import BackendStats, FrontendMetrics
from frontend.validation import GenerateInput, ValidationError, validate_and_tokenize_async
from pagedserve.convert import FINISH_REASONS, sampling_to_proto, scheduler_update_from_proto, token_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import generate_pb2, generate_pb2_grpc, scheduler_pb2

logger = logging.getLogger(__name__)

GRPC_CODES = {
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "error": grpc.StatusCode.INTERNAL,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}
# A metrics scrape waits at most twice this for the scheduler's stats (which wait at most this for the KV
# cache service's).
STATS_TIMEOUT_S = 2.0
# Between attempts to reopen the stream to the scheduler (on top of the channel's own reconnect backoff).
RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 2.0


@dataclass
class _InFlight:
    """A submitted request as the link remembers it, to re-submit it to a restarted scheduler."""

    add: scheduler_pb2.AddRequest
    inbox: "queue.SimpleQueue | object"  # anything with put(): outputs go there as pagedserve.step.RequestOutput
    output_token_ids: list[int] = field(default_factory=list)  # received from the scheduler so far
    done: bool = False  # finished or aborted: never re-submitted


class SchedulerLink:
    """The frontend's one stream to the scheduler: requests go out, each output goes to its request's queue.

    When the stream breaks (the scheduler died), the link opens a new one, which waits for the scheduler
    to be back (wait_for_ready), and re-submits on it every request in flight with the tokens it has
    produced so far: the restarted scheduler continues them, and their client streams simply go on.
    Requests submitted meanwhile wait on the new stream, as long as their callers wait for them.

    Draining (SIGTERM), the link refuses new calls and carries on those it has; idle() says when they
    have all been released.
    """

    def __init__(self, scheduler_stub) -> None:
        self.scheduler = scheduler_stub
        self.in_flight: dict[str, _InFlight] = {}
        self.lock = threading.Lock()
        self.closing = False
        self.draining = False
        self.outgoing: queue.SimpleQueue | None = None
        with self.lock:
            self._open()
        threading.Thread(target=self._run, name="scheduler-link", daemon=True).start()

    def _open(self) -> None:
        """Replaces the stream by a new one that starts with every request in flight. Holds the lock, so
        that a submit or an abort goes either before (and is re-submitted or skipped) or onto the new one."""
        if self.outgoing is not None:
            self.outgoing.put(None)  # ends the old stream's message generator
        self.outgoing = queue.SimpleQueue()
        for entry in self.in_flight.values():
            if not entry.done:
                add = scheduler_pb2.AddRequest()
                add.CopyFrom(entry.add)
                add.output_token_ids[:] = entry.output_token_ids
                self.outgoing.put(scheduler_pb2.SchedulerRequest(add=add))
        self.stream = self.scheduler.Connect(self._outgoing_messages(self.outgoing), wait_for_ready=True)

    @staticmethod
    def _outgoing_messages(outgoing: queue.SimpleQueue):
        while True:
            message = outgoing.get()
            if message is None:
                return
            yield message

    def _run(self) -> None:
        delay = RECONNECT_MIN_S
        while True:
            opened = time.monotonic()
            reason = self._read(self.stream)
            if self.closing:
                return
            # A stream that failed at once (the scheduler is up but refuses it) must not be retried in a
            # hot loop; one that lived is reopened almost at once.
            lived = time.monotonic() - opened > RECONNECT_MAX_S
            delay = RECONNECT_MIN_S if lived else min(2 * delay, RECONNECT_MAX_S)
            with self.lock:
                count = sum(not entry.done for entry in self.in_flight.values())
            logger.warning("%s; re-submitting %d requests in flight once it is back", reason, count)
            time.sleep(delay)
            with self.lock:
                if self.closing:
                    return
                self._open()

    def _read(self, stream) -> str:
        try:
            for update in stream:
                routes = []
                outputs = scheduler_update_from_proto(update)
                with self.lock:
                    for output in outputs:
                        entry = self.in_flight.get(output.request_id)
                        if entry is None:
                            continue
                        entry.output_token_ids.extend(output.new_token_ids)
                        if output.finish_reason is not None:
                            entry.done = True
                        routes.append((entry.inbox, output))
                for inbox, output in routes:
                    inbox.put(output)
            return "the scheduler closed the stream"
        except grpc.RpcError as error:
            return f"lost the scheduler: {error.code().name}"
        except ValueError as error:  # nothing of that update is trusted: the stream starts again
            stream.cancel()
            return f"the scheduler sent a malformed update ({error})"

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               cache_salt: str | None, inbox=None, priority: int = 0, new_call: bool = True):
        """Sends the request; its outputs go to `inbox` (a new SimpleQueue if not given), which is returned.
        Several requests may share one inbox: outputs carry their request id. new_call: the request
        starts a call (refused while draining), rather than continuing one (another of its choices)."""
        add = scheduler_pb2.AddRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, cache_salt=cache_salt or "", priority=priority,
        )
        sampling_to_proto(params, add.sampling)
        entry = _InFlight(add, queue.SimpleQueue() if inbox is None else inbox)
        with self.lock:
            if self.closing:
                raise ConnectionError("the frontend is shutting down")
            if self.draining and new_call:
                raise ConnectionError(DRAINING)
            if request_id in self.in_flight:
                raise KeyError(request_id)
            self.in_flight[request_id] = entry
            self.outgoing.put(scheduler_pb2.SchedulerRequest(add=add))
        return entry.inbox

    def abort(self, request_id: str) -> None:
        with self.lock:
            entry = self.in_flight.get(request_id)
            if entry is not None:
                entry.done = True
            self.outgoing.put(scheduler_pb2.SchedulerRequest(abort=scheduler_pb2.AbortRequest(request_id=request_id)))

    def release(self, request_id: str) -> None:
        with self.lock:
            self.in_flight.pop(request_id, None)

    def start_draining(self) -> None:
        with self.lock:
            self.draining = True

    def idle(self) -> bool:
        """No request submitted and not yet released (its call ended)."""
        with self.lock:
            return not self.in_flight

    def close(self) -> None:
        with self.lock:
            self.closing = True
            self.outgoing.put(None)
            inboxes = [entry.inbox for entry in self.in_flight.values()]
        self.stream.cancel()
        for inbox in inboxes:
            inbox.put(None)


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
        priority=request.priority,
        add_special_tokens=request.add_special_tokens if request.HasField("add_special_tokens") else None,
    )
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "skip_special_tokens",
                 "repetition_penalty", "json_schema", "n", "prompt_logprobs", "regex", "truncate_prompt_tokens",
                 "grammar"):
        if sampling.HasField(name):
            setattr(inp, name, getattr(sampling, name))
    inp.choice = list(sampling.choice) or None
    inp.presence_penalty = sampling.presence_penalty
    inp.frequency_penalty = sampling.frequency_penalty
    inp.logit_bias = dict(sampling.logit_bias)
    inp.allowed_token_ids = list(sampling.allowed_token_ids) or None
    inp.bad_words = list(sampling.bad_words)
    inp.json_object = sampling.json_object
    which = request.WhichOneof("input")
    if which == "prompt":
        inp.prompt = request.prompt
    elif which == "prompt_token_ids":
        inp.prompt_token_ids = list(request.prompt_token_ids.ids)
    elif which == "messages":
        chat = request.messages
        inp.messages = [_chat_message(m) for m in chat.messages]
        if chat.HasField("tools"):
            inp.tools = json_format.MessageToDict(chat.tools)
        if chat.HasField("add_generation_prompt"):
            inp.add_generation_prompt = chat.add_generation_prompt
        inp.continue_final_message = chat.continue_final_message
        if chat.HasField("chat_template_kwargs"):
            inp.chat_template_kwargs = json_format.MessageToDict(chat.chat_template_kwargs)
    return inp


def _chat_message(message: generate_pb2.ChatMessage) -> dict:
    out = {"role": message.role, "content": message.content}
    for name in ("name", "tool_call_id"):
        if getattr(message, name):
            out[name] = getattr(message, name)
    if message.HasField("tool_calls"):
        out["tool_calls"] = json_format.MessageToDict(message.tool_calls)
    return out


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Served on gRPC's asyncio server (AioService): every call is a task of its one event loop, which reads
    its outputs from an AsyncInbox; nothing here blocks that loop but the tokenizer."""

    def __init__(self, link: SchedulerLink, tokenizer, info: scheduler_pb2.SchedulerInfo,
                 max_prompt_chars: int, max_streams: int, metrics: FrontendMetrics | None = None,
                 sampling_defaults: dict | None = None) -> None:
        self.link = link
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.info = info
        self.max_prompt_chars = max_prompt_chars
        self.sampling_defaults = sampling_defaults or {}  # the model's (generation_config_defaults)
        # Client request ids in flight here. The scheduler sees a fresh id per submission instead: it frees
        # an id a step after the request ends, and a client may reuse its own the moment its stream ends.
        # (Only the loop's thread touches it.)
        self.in_flight: set[str] = set()
        # Calls beyond it wait for a stream to end, as they waited for a worker thread on the sync server.
        self.streams = asyncio.Semaphore(max_streams)

    async def GetModelInfo(self, request, context):
        return generate_pb2.ModelInfo(
            model=self.info.model, max_model_len=self.info.max_model_len, vocab_size=self.info.vocab_size
        )

    async def Generate(self, request, context):
        inp = _generate_input(request)
        try:
            prompt_ids, params = await validate_and_tokenize_async(
                inp, self.tokenizer, self.info.max_model_len, self.info.vocab_size,
                max_prompt_chars=self.max_prompt_chars, sampling_defaults=self.sampling_defaults,
            )
        except ValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        request_id = inp.request_id
        if request_id in self.in_flight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")
        self.in_flight.add(request_id)
        try:
            async with self.streams:
                call = GenerateCall(self.link, self.tokenizer, prompt_ids, params, inp.cache_salt, AsyncInbox(),
                                    priority=inp.priority, metrics=self.metrics)
                # A cancel or a deadline cancels this generator where it awaits its inbox, and the finally
                # below runs then; one that comes while gRPC sends a response leaves it suspended until it is
                # closed. The callback tells the scheduler at once either way (aborting a finished request is
                # a no-op there).
                context.add_done_callback(lambda _: call.abort())
                try:
                    call.start()
                    while not call.finished:
                        output = await call.inbox.queue.get()
                        for output in with_the_rest(output, call.inbox.queue):
                            yield _response(request_id, call.process(output))
                except GenerateError as error:
                    await context.abort(GRPC_CODES[error.kind], str(error))
                finally:
                    call.close()
        finally:
            self.in_flight.discard(request_id)


def _response(request_id: str, delta) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(
        request_id=request_id, token_ids=delta.token_ids, text=delta.text, index=delta.index,
    )
    for token in delta.logprobs or []:
        token_to_proto(token, response.logprobs.add())
    for token in delta.prompt_logprobs or []:
        token_to_proto(token, response.prompt_logprobs.add())
    if delta.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[delta.finish_reason]
        response.usage.prompt_tokens = delta.usage.prompt_tokens
        response.usage.completion_tokens = delta.usage.completion_tokens
    return response


def read_backend_stats(scheduler_stub) -> BackendStats | None:
    """The scheduler's stats for a metrics scrape; None when it does not answer in time."""
    try:
        stats = scheduler_stub.GetStats(scheduler_pb2.SchedulerStatsRequest(include_kv_cache=True),
                                        timeout=2 * STATS_TIMEOUT_S)
    except grpc.RpcError:
        return None
    kv = stats.kv_cache if stats.HasField("kv_cache") else None
    return BackendStats(
        num_running=stats.num_running, num_waiting=stats.num_waiting, num_preemptions=stats.num_preemptions,
        kv_cache_usage=kv.usage if kv is not None else None,
        prefix_cache_queries=kv.prefix_cache_queries if kv is not None else None,
        prefix_cache_hits=kv.prefix_cache_hits if kv is not None else None,
    )
