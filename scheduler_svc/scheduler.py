"""Continuous batching: which requests run this step, how many tokens each, and who gets preempted.

Each step spends a token budget. Running requests come first, in admission order: a decode costs one
token, a partial prefill the next chunk of its prompt. Waiting requests are admitted, FCFS, with what
budget is left (a long prompt gets a chunk now and the rest in later steps), unless a request was preempted
this step. When the pool cannot give a running request its next block, the newest running request gives
all of its blocks back and returns to the head of the waiting queue, to be recomputed later (its output
does not change: it resumes from the tokens it already has).

Blocks are counted here from the free count the block manager reported after the previous step, so that
the step needs exactly one call to it; the block manager stays the authority and may still refuse a
request, which is then preempted like any other.
"""
from __future__ import annotations

from collections import deque
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
)
from scheduler_svc.request import Request, RequestStatus


@dataclass(slots=True)
class _Scheduled:
    request: Request
    num_new_tokens: int
    admitted: bool  # newly admitted this step (its prompt goes to the block manager for prefix lookup)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocate_blocks: Callable[[BlockStepRequest], BlockStepResult],
        num_free_blocks: int,
    ) -> None:
        self.config = config
        self.allocate_blocks = allocate_blocks
        self.num_free_blocks = num_free_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Ended since the last step: the block manager frees them and the executor drops their state.
        self.pending_frees: list[str] = []
        self.num_preemptions = 0

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
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.finish_reason = "abort"
        self._finish(request)
        return self._output(request, [])

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step

    def step(self, execute: Callable[[ExecuteStep], ExecuteResult]) -> list[RequestOutput]:
        execute_step = self.schedule()
        return self.update(execute_step, execute(execute_step))

    def schedule(self) -> ExecuteStep:
        budget = self.config.max_num_batched_tokens
        free_blocks = self.num_free_blocks
        scheduled: list[_Scheduled] = []
        preempted_now = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            needed = self._blocks_needed(request, num_new)
            while needed > free_blocks:
                victim = self.running.pop()
                free_blocks += victim.num_blocks
                self._preempt(victim)
                preempted_now = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            free_blocks -= needed
            scheduled.append(_Scheduled(request, num_new, admitted=False))
            budget -= num_new
            index += 1

        while (
            self.waiting and budget > 0 and not preempted_now
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            needed = self._blocks_needed(request, num_new)
            if needed > free_blocks:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            free_blocks -= needed
            scheduled.append(_Scheduled(request, num_new, admitted=True))
            budget -= num_new

        blocks = self.allocate_blocks(BlockStepRequest(
            free_request_ids=self.pending_frees, requests=[self._block_request(s) for s in scheduled]
        ))
        finished_ids, self.pending_frees = self.pending_frees, []
        self.num_free_blocks = blocks.num_free_blocks
        refused = set(blocks.failed_request_ids)
        for s in scheduled:
            if s.request.request_id in refused:
                self._refused(s)
        # A running request refused here is preempted; the blocks it still holds go back in the next
        # step's call.
        requests = [self._execute_request(s, blocks) for s in scheduled if s.request.request_id not in refused]
        return ExecuteStep(
            requests=requests, finished_request_ids=finished_ids,
            save_blocks=blocks.saves_before, save_blocks_after=blocks.saves_after,
        )

    def update(self, step: ExecuteStep, result: ExecuteResult) -> list[RequestOutput]:
        outputs = []
        for executed in step.requests:
            token = result.sampled.get(executed.request_id)
            request = self.requests.get(executed.request_id)
            if token is None or request is None:
                continue
            request.append_token(token)
            if request.finish_reason is not None:
                self.running.remove(request)
                self._finish(request)
            logprobs = [token] if request.sampling_params.logprobs is not None else None
            outputs.append(self._output(request, [token.token_id], logprobs))
        return outputs

    # ------------------------------------------------------------------ accounting

    def kv_slot_usage(self) -> tuple[int, int]:
        """(slots holding computed or scheduled tokens, slots allocated) over running requests."""
        used = sum(r.num_computed_tokens for r in self.running)
        allocated = sum(r.num_blocks for r in self.running) * self.config.block_size
        return used, allocated

    def _blocks_needed(self, request: Request, num_new: int) -> int:
        total = request.num_computed_tokens + num_new
        return max(0, -(-total // self.config.block_size) - request.num_blocks)

    @staticmethod
    def _block_request(s: _Scheduled) -> BlockRequest:
        request = s.request
        known, sent = request.num_tokens, request.num_tokens_sent_to_kv
        request.num_tokens_sent_to_kv = known
        if s.admitted:
            return BlockRequest(
                request.request_id, s.num_new_tokens,
                prompt_token_ids=request.token_ids(0, known), cache_salt=request.cache_salt,
            )
        return BlockRequest(
            request.request_id, request.num_computed_tokens + s.num_new_tokens,
            new_token_ids=request.token_ids(sent, known) if known > sent else None,
        )

    def _execute_request(self, s: _Scheduled, blocks: BlockStepResult) -> ExecuteRequest:
        request = s.request
        new_block_ids = blocks.new_block_ids.get(request.request_id, [])
        request.num_blocks += len(new_block_ids)
        loads = blocks.tier_loads.get(request.request_id, []) if s.admitted else []
        if s.admitted:
            # The block manager found this many leading tokens computed already (in the pool, or in the
            # offload tier for the last len(loads) blocks of them): the step starts after them.
            request.num_computed_tokens = blocks.num_cached_tokens.get(request.request_id, 0)
        end = min(request.num_computed_tokens + s.num_new_tokens, request.num_tokens)
        # Tokens of blocks to load travel too, so that the executor can compute them if a load fails.
        start = request.num_computed_tokens - len(loads) * self.config.block_size
        first_time = not request.executor_has_state
        request.executor_has_state = True
        request.num_computed_tokens = end
        return ExecuteRequest(
            request_id=request.request_id,
            token_ids=request.token_ids(start, end),
            start_position=start,
            new_block_ids=new_block_ids,
            sample=end == request.num_tokens,
            sampling_params=request.sampling_params if first_time else None,
            prompt_len=len(request.prompt_token_ids) if first_time else 0,
            load_blocks=loads,
        )

    def _refused(self, s: _Scheduled) -> None:
        request = s.request
        self.running.remove(request)
        if s.admitted:
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        else:
            self._preempt(request)

    def _preempt(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_tokens_sent_to_kv = 0
        request.num_blocks = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.executor_has_state = False
        self.pending_frees.append(request.request_id)
        self.waiting.appendleft(request)

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.num_free_blocks += request.num_blocks
        self.pending_frees.append(request.request_id)
        del self.requests[request.request_id]

    def _output(self, request: Request, new_token_ids: list[int], logprobs=None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            finish_reason=request.finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=len(request.output_token_ids),
        )
