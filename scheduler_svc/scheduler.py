"""Continuous batching: which requests run this step and how many tokens each. The policy lives here;
the block arithmetic lives in the block manager.

Each step spends a token budget. Running requests come first, in admission order: a decode costs one
token, a partial prefill the next chunk of its prompt. Waiting requests are offered for admission, FCFS,
with what budget is left (a long prompt gets a chunk now and the rest in later steps). The step goes to
the block manager as one call with every running request in priority order and the waiting candidates;
it grows the running ones in order and, when the pool runs short, preempts from the tail (the newest
running request gives all of its blocks back and returns to the head of the waiting queue, to be
re-admitted later from the tokens it already has, so its output does not change; what of its K/V the block
manager kept, in the pool, the offload tier or the swap space, is loaded rather than recomputed). The
scheduler never counts blocks itself.

Under the priority policy both queues are kept in (priority, arrival) order, so the block manager's
preemption from the tail takes the lowest priority, then the newest. Two limits keep a huge prompt from
stalling everyone: long_prefill_token_threshold caps the prompt tokens one request computes per step, and
max_num_partial_prefills caps how many requests are part-way through their prompt at once (a prompt that
would start another waits while shorter ones that finish within the step go ahead).

A step can be planned before the result of the one before it has come back (steps planned ahead, see
engine_loop.py): a request that samples in a step still out counts one more token, whose id it does not
know yet; the next step computes that token all the same (the executor feeds in what it sampled), and the
block manager is told its id one step later. A request that turns out to have finished with the token
still out was planned once more for nothing: the token that step samples for it is dropped, and its
blocks go back. One whose pending token reaches max_tokens is not planned again. With three steps out a
request can have two samples pending; one preempted meanwhile is re-admitted only once they have come
back, since an admission names every token it starts from.

With three steps out the scheduler also asks the block manager to reserve a block's worth of slots ahead
for each running request (reserve_ahead), and plans a step without calling it when no running request
needs more slots than the block manager said its table holds, nobody waits to be admitted and nothing is
to be freed; the tokens of those steps go to the block manager with the next call. A block reserved for a
request that has no row in that step (its budget spent, or its last sample pending) goes with its next row.

A step that fails is rolled back by recompute, together with any step sent after it: their requests give
their blocks back and are re-admitted (mostly from the prefix cache, which indexes a block only once its
step has run). A request the executor refuses (a bad token id, block or position) fails alone with the
reason. When the executor raises for a step of several requests, nobody can tell which one caused it: each
of them then runs in a step alone until one has succeeded, so that a request that fails again fails alone
and the others go on.

With several executors, the block manager admits each waiting request on one of them (the one holding the
longest cached prefix of it, see kvcache_svc/executor_pools.py) and the request stays there while it runs:
the step is planned once, then split into one part per executor, sent at once; its result is theirs merged.

A request the executor defers (its grammar is still compiling) has its last token computed again in the
next step, which samples it. A request that asks for its prompt's logprobs is admitted under a cache salt
of its own until it has them all: a prompt taken from the prefix cache would not be computed, so not scored.
"""
from __future__ import annotations

import bisect
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.config import SchedulerConfig
from pagedserve.step import (
    BlockRequest,
    BlockStepRequest,
    BlockStepResult,
    ExecuteRequest,
    ExecuteResult,
    ExecuteStep,
    RequestOutput,
    num_loaded_tokens,
)
from scheduler_svc.request import Request, RequestStatus

CALL_SECONDS_WEIGHT = 0.1  # of the latest call in the running average of a block-manager call's time


class BlockManagerUnavailable(Exception):
    """The block manager did not answer: nothing was planned, and the step may simply be tried again."""


class ExecutorUnavailable(Exception):
    """The executor did not answer, or is not the instance the step was planned for: the step's outcome is
    unknown."""


class StepFailed(Exception):
    """The executor ran the step and raised."""


@dataclass(slots=True)
class _Scheduled:
    request: Request
    num_new_tokens: int
    num_left: int  # tokens it had left to compute before this step

    @property
    def partial(self) -> bool:
        """Part-way through its prompt (or recompute) after this step."""
        return 0 < self.num_new_tokens < self.num_left


class Scheduler:
    def __init__(self, config: SchedulerConfig,
                 allocate_blocks: Callable[[BlockStepRequest], dict[str, BlockStepResult]],
                 executor_epoch: str = "") -> None:
        """allocate_blocks: the block manager's answer per executor address (see pagedserve.step.one_executor
        for one executor's pool). executor_epoch: the instance plans are for, when driving one executor."""
        self.config = config
        self.allocate_blocks = allocate_blocks
        # This scheduler instance, and the executor instance its plans are for (see BlockStepRequest).
        self.scheduler_id = uuid.uuid4().hex
        self.executor_epoch = executor_epoch
        self.next_step_id = 1
        self.planned_step_id = 0  # of the last plan the block manager served
        # Plans the executor ran since the last call to the block manager, and the requests whose part of
        # them failed.
        self.executed_step_ids: list[int] = []
        self.failed_request_ids: list[str] = []
        # The requests of each step sent and not applied yet, row for row (by step id): the result goes to
        # these objects, whatever became of them since.
        self.planned_requests: dict[int, list[Request]] = {}
        self.suspects: set[str] = set()  # in a step that raised: each runs alone until one succeeds
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_arrivals = 0
        self.requests: dict[str, Request] = {}
        # Ended since the last step: the block manager frees them and the executor drops their state.
        self.pending_frees: list[str] = []
        self.num_preemptions = 0
        # Computed, then given back (preemption, a failed step): recomputed, or loaded where a copy was kept.
        self.num_recomputed_tokens = 0
        # Reserving slots ahead (set by the engine loop while it keeps three steps out): the block manager
        # gives each running request a block's worth of slots more than it needs, and a step that needs no
        # more slots than the requests hold, admits nobody and frees nothing is planned without calling it.
        self.reserve_ahead = False
        # The executor instance of each pool in the last answer, which a step planned without a call goes to.
        self.answer_epochs: dict[str, str] = {}
        # The time a call to the block manager takes (running average), and the calls skipped and the time
        # they would have taken (the engine loop counts that time as its work, so that skipping calls does not
        # make it stop reserving).
        self.call_seconds = 0.0
        self.num_calls_skipped = 0
        self.call_seconds_skipped = 0.0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if len(request.prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(request.prompt_token_ids)} tokens; the context length is "
                f"{self.config.max_model_len}, leaving no room to generate"
            )
        request.arrival = self.num_arrivals
        self.num_arrivals += 1
        request.queued_at = time.monotonic()
        self.requests[request.request_id] = request
        self._enqueue(self.waiting, request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        return self._end(request, "abort") if request is not None else None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step

    def step(self, execute: Callable[[ExecuteStep], ExecuteResult]) -> list[RequestOutput]:
        execute_step = self.schedule()
        return self.update(execute_step, execute(execute_step))

    def schedule(self) -> ExecuteStep:
        """Plans the next step with one call to the block manager; raises BlockManagerUnavailable, with
        nothing changed, when that call fails."""
        # A suspect runs alone: the running requests keep their place but get no tokens this step.
        budget = 0 if self.suspects else self.config.max_num_batched_tokens
        running: list[_Scheduled] = []
        num_partial = 0
        for request in self.running:
            num_left = request.num_tokens_to_compute()
            scheduled = _Scheduled(request, self._chunk(num_left, budget), num_left)
            running.append(scheduled)
            budget -= scheduled.num_new_tokens
            num_partial += scheduled.partial
        candidates = self.waiting
        if self.suspects:
            budget = self.config.max_num_batched_tokens
            candidates = [next(r for r in self.waiting if r.request_id in self.suspects)]
        partial_limit = self.config.max_num_partial_prefills or len(self.requests)
        waiting: list[_Scheduled] = []
        room = 1 if self.suspects else max(self.config.max_num_seqs - len(self.running), 0)
        for request in candidates:
            if len(waiting) == room or budget <= 0 or request.num_pending_samples:
                break  # (one preempted with a sample still out is admitted once that sample is known)
            num_left = request.num_tokens_to_compute()
            scheduled = _Scheduled(request, self._chunk(num_left, budget), num_left)
            if scheduled.partial:
                if not self.config.enable_chunked_prefill:
                    break
                if num_partial == partial_limit:
                    continue  # this one would start another partial prefill: shorter ones may go ahead
                num_partial += 1
            waiting.append(scheduled)
            budget -= scheduled.num_new_tokens

        step_id = self.next_step_id
        self.next_step_id += 1
        if self._needs_no_call(running, waiting):
            answers = {address: BlockStepResult(executor_epoch=epoch) for address, epoch in self.answer_epochs.items()}
            self.num_calls_skipped += 1
            self.call_seconds_skipped += self.call_seconds
        else:
            answers = self._call_block_manager(step_id, running, waiting)
        executor_frees, self.pending_frees = self.pending_frees, []
        # A waiting request is admitted on the executor whose answer serves it.
        admitted_on = {request_id: address for address, blocks in answers.items() for request_id in blocks.new_block_ids}
        admitted = [s for s in waiting if s.request.request_id in admitted_on]
        now = time.monotonic() if admitted else 0.0
        for s in admitted:
            self.waiting.remove(s.request)
            s.request.status = RequestStatus.RUNNING
            if s.request.scheduled_at is None:  # (not again after a preemption: the queue time is the first wait)
                s.request.scheduled_at, s.request.times_pending = now, True
            s.request.executor_id = admitted_on[s.request.request_id]
            self._enqueue(self.running, s.request)
        preempted_ids = [request_id for blocks in answers.values() for request_id in blocks.preempted_request_ids]
        for request_id in preempted_ids:
            self._preempt(self.requests[request_id])
        # Each executor drops the state of requests that ended, whichever it held (an unknown id is ignored).
        executor_frees += preempted_ids
        preempted = set(preempted_ids)
        scheduled = [s for s in running if s.num_new_tokens > 0 and s.request.request_id not in preempted] \
            if preempted else [s for s in running if s.num_new_tokens > 0]
        if len(scheduled) < len(running):
            self._keep_unsent_blocks(running, preempted, answers)
        requests = [self._running_row(s, answers[s.request.executor_id]) for s in scheduled]
        requests += [self._admitted_row(s, answers[s.request.executor_id]) for s in admitted]
        planned = [s.request for s in scheduled]
        planned += [s.request for s in admitted]
        self.planned_requests[step_id] = planned
        parts = [
            ExecuteStep(
                requests=requests if len(answers) == 1 else
                [row for row, request in zip(requests, planned) if request.executor_id == address],
                finished_request_ids=executor_frees, executor_epoch=self.answer_epochs[address],
                scheduler_id=self.scheduler_id, save_blocks=blocks.saves_before, save_blocks_after=blocks.saves_after,
                step_id=step_id, swap_out=blocks.swap_out, swap_free=blocks.swap_free, executor_id=address,
            )
            for address, blocks in answers.items()
        ]
        if len(parts) == 1:
            return parts[0]
        return ExecuteStep(requests=requests, scheduler_id=self.scheduler_id, step_id=step_id, parts=parts)

    def _needs_no_call(self, running: list[_Scheduled], waiting: list[_Scheduled]) -> bool:
        """Whether the step can be planned without the block manager: slots are reserved ahead, and there is
        nothing to admit or free and no running request that needs more slots than its table holds."""
        if not self.reserve_ahead or waiting or self.pending_frees or self.suspects or not self.answer_epochs:
            return False
        epochs = self.answer_epochs
        for s in running:
            request = s.request
            if request.num_computed_tokens + s.num_new_tokens > request.num_slots or request.executor_id not in epochs:
                return False
        return True

    def _call_block_manager(self, step_id: int, running: list[_Scheduled],
                            waiting: list[_Scheduled]) -> dict[str, BlockStepResult]:
        started = time.perf_counter()
        answers = self.allocate_blocks(BlockStepRequest(
            scheduler_id=self.scheduler_id, executor_epoch=self.executor_epoch, step_id=step_id,
            executed_step_ids=self.executed_step_ids, failed_request_ids=self.failed_request_ids,
            planned_step_id=self.planned_step_id,
            free_request_ids=self.pending_frees,
            running=[self._grow_request(s) for s in running],
            waiting=[self._admit_request(s) for s in waiting],
            lookahead_slots=self.config.block_size if self.reserve_ahead else 0,
        ))
        self.call_seconds += CALL_SECONDS_WEIGHT * (time.perf_counter() - started - self.call_seconds)
        self.planned_step_id, self.executed_step_ids, self.failed_request_ids = step_id, [], []
        for s in running:  # the block manager now knows every token these requests have
            s.request.num_tokens_sent_to_kv = s.request.num_tokens
        self.answer_epochs = {address: blocks.executor_epoch or self.executor_epoch
                              for address, blocks in answers.items()}
        requests = self.requests
        for blocks in answers.values():
            for request_id, num_slots in blocks.num_slots.items():
                if (request := requests.get(request_id)) is not None:
                    request.num_slots = num_slots
        return answers

    @staticmethod
    def _keep_unsent_blocks(running: list[_Scheduled], preempted: set[str],
                            answers: dict[str, BlockStepResult]) -> None:
        """Blocks given to a running request that has no row this step (reserved ahead, or sent again after an
        answer that was lost) go with its next row."""
        for s in running:
            request = s.request
            if s.num_new_tokens == 0 and request.request_id not in preempted:
                block_ids = answers[request.executor_id].new_block_ids.get(request.request_id)
                if block_ids:
                    request.unsent_block_ids += block_ids

    def update(self, step: ExecuteStep, result: ExecuteResult) -> list[RequestOutput]:
        """Applies a step's result. A request that ended since the step was planned gets nothing (its token
        would come after its last one); one preempted since gets its token all the same (the step computed
        it from the request's true context), and will recompute it with the rest."""
        self.executed_step_ids.append(step.step_id)
        outputs = []
        sampled, rejected, deferred = result.sampled, result.rejected, set(result.deferred)
        prompt_logprobs, suspects = result.prompt_logprobs, self.suspects
        # Every running request comes through here every step: the rare cases are looked at only when present.
        for executed, request in zip(step.requests, self.planned_requests.pop(step.step_id)):
            if suspects:
                suspects.discard(request.request_id)
            if request.status is RequestStatus.FINISHED:
                continue
            if executed.sample:
                request.num_pending_samples -= 1
            if rejected and request.request_id in rejected:
                self.failed_request_ids.append(request.request_id)
                outputs.append(self._end(request, "error", rejected[request.request_id]))
                continue
            run = prompt_logprobs.get(request.request_id) if prompt_logprobs else None
            if run is not None:
                request.add_prompt_logprobs(run)
            if deferred and request.request_id in deferred:
                # Not sampled (its grammar is still compiling): its last token is computed again, and sampled,
                # in a later step. (No step was planned on it meanwhile: see Request.num_tokens_to_compute; a
                # request preempted since recomputes it anyway.)
                if request.status is RequestStatus.RUNNING:
                    request.num_computed_tokens -= 1
                    self.num_recomputed_tokens += 1
                continue
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_token(token)
            if request.finish_reason is not None:
                self._dequeue(request)
                self._finish(request)
            logprobs = [token] if request.sampling_params.logprobs is not None else None
            output = self._output(request, [token.token_id], logprobs)
            if request.times_pending:
                output.queue_time_s = request.scheduled_at - request.queued_at
                output.prefill_time_s = time.monotonic() - request.scheduled_at
                request.times_pending = False
            if request.sampling_params.prompt_logprobs is not None and not request.wants_prompt_logprobs \
                    and not request.prompt_logprobs_sent:
                output.prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
            outputs.append(output)
        return outputs

    # ------------------------------------------------------------------ failures

    def steps_failed(self, steps: list[ExecuteStep], error: str | None) -> list[RequestOutput]:
        """Rolls back the steps the executor did not complete: the first one failed, and those sent after it
        are void whatever became of them (they followed a step that did not run). Their requests give their
        blocks back and are recomputed. error: what the executor raised for the first (None when it did not
        answer, which is no request's fault). A request that raised alone fails with it; of several, each
        becomes a suspect."""
        rows = [[r for r in self.planned_requests.pop(step.step_id) if r.status is not RequestStatus.FINISHED]
                for step in steps]
        failing = rows[0]
        outputs = []
        if error is not None and len(failing) == 1:
            outputs.append(self._end(failing[0], "error", f"the executor failed on this request: {error}"))
        affected = list(dict.fromkeys(r for step_rows in rows for r in step_rows if r.status is not RequestStatus.FINISHED))
        for request in reversed(affected):  # back to the head of the queue in their order
            request.num_pending_samples = 0
            if request.status is RequestStatus.RUNNING:  # (one preempted while its step was out already is waiting)
                self._preempt(request)
            self.pending_frees.append(request.request_id)
            if error is not None and request in failing:
                self.suspects.add(request.request_id)
        return outputs

    def executor_replaced(self, executor_epoch: str) -> None:
        """A new executor instance holds none of the KV of the running requests: all are recomputed (the
        block manager drops the old instance's blocks when it sees the new epoch)."""
        self.executor_epoch = executor_epoch
        for request in list(reversed(self.running)):
            self._preempt(request)
            self.pending_frees.append(request.request_id)

    def _end(self, request: Request, finish_reason: str, error: str | None = None) -> RequestOutput:
        """Ends an unfinished request (aborted, or failed with error)."""
        self._dequeue(request)
        request.finish_reason = finish_reason
        self._finish(request)
        output = self._output(request, [])
        output.error = error
        return output

    # ------------------------------------------------------------------ policy

    def _chunk(self, num_left: int, budget: int) -> int:
        """The tokens a request computes this step, out of what it still has to and what budget is left."""
        num_new = min(num_left, budget)
        if self.config.long_prefill_token_threshold and num_new > 1:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return num_new

    def _dequeue(self, request: Request) -> None:
        (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)

    def _enqueue(self, queue: list[Request], request: Request, front: bool = False) -> None:
        """FCFS: to the back (front: a preempted request, first to be re-admitted); priority: in (priority,
        arrival) order, wherever it comes from."""
        if self.config.scheduling_policy == "priority":
            bisect.insort(queue, request, key=lambda r: (r.priority, r.arrival))
        elif front:
            queue.insert(0, request)
        else:
            queue.append(request)

    # ------------------------------------------------------------------ messages

    @staticmethod
    def _grow_request(s: _Scheduled) -> BlockRequest:
        request = s.request
        known, sent = request.num_tokens, request.num_tokens_sent_to_kv
        return BlockRequest(
            request.request_id, request.num_computed_tokens + s.num_new_tokens,
            new_token_ids=request.token_ids(sent, known) if known > sent else None, new_tokens_start=sent,
            executor_id=request.executor_id,
        )

    @staticmethod
    def _admit_request(s: _Scheduled) -> BlockRequest:
        request = s.request
        # The prompt's logprobs come from computing it: a salt of its own for this admission finds nothing
        # cached (vLLM skips the prefix cache for these requests too).
        salt = f"prompt-logprobs:{uuid.uuid4().hex}" if request.wants_prompt_logprobs else request.cache_salt
        return BlockRequest(
            request.request_id, s.num_new_tokens,
            prompt_token_ids=request.token_ids(0, request.num_tokens), cache_salt=salt,
        )

    @staticmethod
    def _running_row(s: _Scheduled, blocks: BlockStepResult) -> ExecuteRequest:
        """A running request's row of the step (every one, every step: kept lean)."""
        request = s.request
        known, start = request.num_tokens, request.num_computed_tokens
        last = known + request.num_pending_samples
        end = min(start + s.num_new_tokens, last)
        request.num_computed_tokens = end
        sample = end == last
        if sample:
            request.num_pending_samples += 1
        token_ids = request.token_ids(start, min(end, known)) if start < known else []
        new_block_ids = blocks.new_block_ids.get(request.request_id, [])
        if request.unsent_block_ids:
            new_block_ids, request.unsent_block_ids = request.unsent_block_ids + new_block_ids, []
        return ExecuteRequest(request.request_id, token_ids, start, new_block_ids, sample, feed_sampled=end > known,
                              prompt_logprobs=request.sampling_params.prompt_logprobs is not None
                              and request.wants_prompt_logprobs)

    def _admitted_row(self, s: _Scheduled, blocks: BlockStepResult) -> ExecuteRequest:
        """An admitted request's row: the executor (re)creates its state, which it sees for the first time since
        admission."""
        request = s.request
        request_id, known = request.request_id, request.num_tokens
        loads = blocks.tier_loads.get(request_id, [])
        # The block manager found this many leading tokens computed already (in the pool, or in the offload
        # tier for the last len(loads) blocks of them): the step starts after them.
        computed = blocks.num_cached_tokens.get(request_id, 0)
        request.num_tokens_sent_to_kv = known
        last = known + request.num_pending_samples  # (none is pending: see schedule)
        end = min(computed + s.num_new_tokens, last)
        # Tokens of blocks to load travel too, so that the executor can compute them if a load fails.
        start = computed - num_loaded_tokens(loads, self.config.block_size) if loads else computed
        request.num_computed_tokens = end
        sample = end == last
        if sample:
            request.num_pending_samples += 1
        params = request.sampling_params
        return ExecuteRequest(
            request_id, request.token_ids(start, min(end, known)) if start < known else [], start,
            blocks.new_block_ids.get(request_id, []), sample, params, len(request.prompt_token_ids), loads,
            prefix_token_ids=request.token_ids(0, start) if params.needs_token_history else [],
            prompt_logprobs=request.wants_prompt_logprobs,
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        self.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.num_tokens_sent_to_kv = 0
        request.num_slots, request.unsent_block_ids = 0, []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(self.waiting, request, front=True)

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.pending_frees.append(request.request_id)
        self.suspects.discard(request.request_id)
        del self.requests[request.request_id]

    def _output(self, request: Request, new_token_ids: list[int], logprobs=None) -> RequestOutput:
        # (Every running request's every token: positional arguments.)
        return RequestOutput(request.request_id, new_token_ids, logprobs, request.finish_reason,
                             len(request.prompt_token_ids), len(request.output_token_ids))
