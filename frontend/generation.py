"""One generate call with its n choices, for either public API (gRPC and HTTP): submit to the scheduler
link, turn each output into a text delta, and know when every choice has ended.

Choices of one prompt share its KV blocks through the prefix cache. The block manager indexes a block only
after the step that computed it has run, so siblings admitted in the same step as the first choice would
each compute the prompt again. The first choice therefore goes alone; the others are submitted when its
first token arrives, which is after its whole prompt has been computed, and are admitted on its blocks
(except when the first asks for the prompt's logprobs: it is admitted under a cache salt of its own).
"""
from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from frontend.metrics import FrontendMetrics
from pagedserve.output import RequestOutputState, Usage
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import RequestOutput, SampledToken, join_outputs

# The finish reasons of a request that failed, with the message its error has when the back end gave none.
FAILURES = {
    "overloaded": "the server is overloaded",
    "unavailable": "the scheduler is shutting down",
    "error": "request failed",
}
# Why a draining frontend refuses a new call.
DRAINING = "this frontend is shutting down and takes no new requests; send them to another frontend"


class GenerateError(Exception):
    """The call cannot go on. kind: "overloaded" (the scheduler refused it), "error" (the request failed in
    the back end) or "unavailable" (the frontend or the scheduler is shutting down)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[SampledToken] | None
    finish_reason: str | None = None  # on the choice's last delta
    usage: Usage | None = None  # of this choice, on its last delta
    # With prompt_logprobs, on choice 0's first delta: those of prompt tokens 1 to the end.
    prompt_logprobs: list[SampledToken] | None = None


class GenerateCall:
    """Feed it every output the link routes to `inbox` (anything with put()); it submits the siblings at the
    right time and returns the text deltas. Call close() when done, whatever happened: it aborts the
    choices still running and forgets them on the link."""

    def __init__(self, link, tokenizer: Any, prompt_ids: list[int], params: SamplingParams,
                 cache_salt: str | None, inbox, priority: int = 0, metrics: FrontendMetrics | None = None,
                 prompt_only: bool = False) -> None:
        """prompt_only: the client asked for no completion (vLLM's echo with max_tokens 0, to score a prompt): the
        request runs to one token, for its prompt logprobs, and the deltas leave that token out."""
        self.link, self.prompt_ids, self.params, self.cache_salt, self.inbox = link, prompt_ids, params, cache_salt, inbox
        self.prompt_only = prompt_only
        self.priority = priority
        self.metrics = metrics
        self.times = [metrics.arrived() for _ in range(params.n)] if metrics is not None else None
        self.failure: str | None = None  # the GenerateError kind that ended the call
        # The scheduler sees fresh ids: a client may reuse its own the moment its call ends.
        self.ids = [uuid.uuid4().hex for _ in range(params.n)]
        self.index = {request_id: i for i, request_id in enumerate(self.ids)}
        self.states = [RequestOutputState(tokenizer, prompt_ids, params) for _ in range(params.n)]
        self.submitted: list[str] = []
        self.ended: set[str] = set()
        self.cancelled = False
        # Prompt logprobs go out once: a scheduler restarted mid-request computes them again for its resubmission.
        self.prompt_logprobs_sent = False

    def start(self) -> None:
        """Submits the first choice; raises GenerateError("unavailable") when the link is closing."""
        self._submit(0)
        if self.metrics is not None:
            self.metrics.prompt(len(self.prompt_ids))

    def _submit(self, index: int) -> None:
        if self.cancelled:
            return
        try:
            # Only the first choice is a new request: a draining frontend still admits the siblings of a
            # call it has taken.
            self.link.submit(self.ids[index], self.prompt_ids, self.params.for_choice(index), self.cache_salt,
                             self.inbox, self.priority, new_call=index == 0)
        except ConnectionError as error:
            self.failure = "unavailable"
            raise GenerateError("unavailable", str(error)) from None
        self.submitted.append(self.ids[index])

    @property
    def finished(self) -> bool:
        return len(self.ended) == len(self.ids)

    def process(self, output: RequestOutput | None) -> ChoiceDelta:
        """The delta of one routed output (None: the link closed); raises GenerateError."""
        if output is None:
            self.failure = "unavailable"
            raise GenerateError("unavailable", "the frontend is shutting down")
        if output.finish_reason in FAILURES:
            self.failure = output.finish_reason
            raise GenerateError(output.finish_reason, output.error or FAILURES[output.finish_reason])
        index = self.index[output.request_id]
        if index == 0 and len(self.submitted) == 1:
            # The first choice's prompt is computed (it has sampled), and its blocks are indexed in the step
            # that admits these.
            for sibling in range(1, len(self.ids)):
                self._submit(sibling)
        delta = self.states[index].update(output.new_token_ids, output.finish_reason)
        if delta.abort:
            self.link.abort(output.request_id)
        if delta.finished:
            self.ended.add(output.request_id)
        num_tokens = delta.num_tokens  # (fewer than given when a stop string ended the choice part-way)
        if self.times is not None:
            if output.queue_time_s is not None:
                self.metrics.scheduled(self.times[index], output.queue_time_s, output.prefill_time_s)
            self.metrics.output(self.times[index], len(output.new_token_ids) if num_tokens is None else num_tokens)
            if delta.finished:
                self.metrics.ended_request(self.times[index], delta.finish_reason)
        prompt_logprobs = None if self.prompt_logprobs_sent else output.prompt_logprobs
        self.prompt_logprobs_sent |= prompt_logprobs is not None
        if self.prompt_only:
            usage = Usage(delta.usage.prompt_tokens, 0) if delta.usage is not None else None
            return ChoiceDelta(index, [], "", [] if output.new_logprobs is not None else None,
                               "length" if delta.finished else None, usage, prompt_logprobs)
        return ChoiceDelta(index, output.new_token_ids[:num_tokens], delta.text,
                           output.new_logprobs[:num_tokens] if output.new_logprobs is not None else None,
                           delta.finish_reason, delta.usage, prompt_logprobs)

    def abort(self) -> None:
        """Aborts the choices still running (the client went away). Safe from any thread."""
        self.cancelled = True
        for request_id in list(self.submitted):
            if request_id not in self.ended:
                self.link.abort(request_id)

    def close(self) -> None:
        self.abort()
        for request_id in self.submitted:
            self.link.release(request_id)
        if self.times is not None:  # every choice that did not finish ends here
            for index, request_id in enumerate(self.ids):
                if request_id not in self.ended:
                    self.metrics.ended_request(self.times[index], self.failure or "abort")
            self.times = None


def with_the_rest(output, inbox: asyncio.Queue) -> list:
    """The output with those that came after it, joined per request: a client that reads slower than the
    steps come gets fewer, bigger messages rather than a growing backlog. Anything else (None: the link
    closed; a reader's own marker) ends the batch and stays in the inbox for the next round."""
    if not isinstance(output, RequestOutput):
        return [output]
    outputs = [output]
    while not inbox.empty():
        more = inbox.get_nowait()
        if not isinstance(more, RequestOutput):
            inbox.put_nowait(more)
            break
        outputs.append(more)
    return join_outputs(outputs)


class AsyncInbox:
    """The link's side of a call served on an event loop (either API's): outputs put from the link's thread
    land in `queue`, an asyncio queue of the loop that made the inbox."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.mail = _mail.get(loop) or _mail.setdefault(loop, _LoopMail(loop))

    def put(self, item) -> None:
        self.mail.put(self.queue, item)


class _LoopMail:
    """Hands items from other threads to a loop's queues, one wake-up for all those put until the loop runs
    them: a step's outputs for hundreds of calls cost one call_soon_threadsafe (a write to the loop's
    self-pipe), not one each."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, object]] = []

    def put(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.pending.append((queue, item))
            if len(self.pending) > 1:  # a delivery is already due
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop has closed: nobody waits for it any more
            pass

    def _deliver(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, item in pending:
            queue.put_nowait(item)


# Each event loop's mail, made by its first inbox.
_mail: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopMail]" = weakref.WeakKeyDictionary()
