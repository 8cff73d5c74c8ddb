"""A request as the scheduler tracks it: its tokens and how many of them have K/V computed (its blocks are
the block manager's to count)."""
from __future__ import annotations

import enum

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import PromptLogprobs, SampledToken


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "stop_ids", "max_output_tokens",
        "output_token_ids", "output_logprobs", "num_computed_tokens", "status", "finish_reason",
        "num_preemptions", "cache_salt", "num_tokens_sent_to_kv", "priority", "arrival", "num_pending_samples",
        "prompt_logprobs", "prompt_logprobs_sent", "executor_id", "num_tokens", "structured", "num_slots",
        "unsent_block_ids", "queued_at", "scheduled_at", "times_pending",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        cache_salt: str | None = None,
        output_token_ids: list[int] = (),
        priority: int = 0,
    ) -> None:
        """output_token_ids: tokens already produced (a request re-submitted after a scheduler restart);
        generation continues after them, and they count toward max_tokens and min_tokens."""
        self.request_id = request_id
        self.priority = priority  # lower runs first, under the priority policy
        self.arrival = 0  # set by the scheduler: the order in which requests came
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        eos = () if sampling_params.ignore_eos else eos_token_ids
        self.stop_ids = frozenset(sampling_params.stop_token_ids) | frozenset(eos)
        room = max_model_len - len(self.prompt_token_ids)
        wanted = sampling_params.max_tokens
        self.max_output_tokens = room if wanted is None else min(wanted, room)
        self.output_token_ids: list[int] = list(output_token_ids)
        # Prompt and outputs (kept, not counted: every step asks it of every running request several times).
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        self.structured = sampling_params.structured
        if self.output_token_ids and len(self.output_token_ids) >= self.max_output_tokens:
            raise ValueError(f"{len(self.output_token_ids)} output tokens already produced: the request has "
                             f"no room left (at most {self.max_output_tokens})")
        self.output_logprobs: list[SampledToken] = []
        # With sampling_params.prompt_logprobs: those of prompt tokens 1, 2, ... received so far, and whether
        # they have gone out (once, whole).
        self.prompt_logprobs: list[SampledToken] = []
        self.prompt_logprobs_sent = False
        # Tokens whose K/V is in the cache (or scheduled this step): the scheduler's only notion of
        # progress; there are no prefill/decode phases, only catching up to num_tokens.
        self.num_computed_tokens = 0
        # Tokens that steps sent to the executor sample for it, not received yet. With steps planned ahead
        # the next step computes such a token (the executor feeds its own sample in), so it counts as a
        # token of the request, only its id is not known yet.
        self.num_pending_samples = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.cache_salt = cache_salt
        self.num_tokens_sent_to_kv = 0  # the block manager knows this many of its tokens
        self.num_slots = 0  # running: the slots its block table holds, as the block manager last said
        # Running: blocks given to it in a step it had no row in, which its next row carries.
        self.unsent_block_ids: list[int] = []
        self.executor_id = ""  # running: the executor (address) it was admitted on
        # Set by the scheduler (time.monotonic): when the request came, and when it was first admitted; its first
        # output with a token reports both (times_pending until then).
        self.queued_at = 0.0
        self.scheduled_at: float | None = None
        self.times_pending = False

    def num_tokens_to_compute(self) -> int:
        """Tokens, known or pending, whose K/V is not computed or scheduled yet; none once a pending sample
        is its last token (max_tokens or the context length), nor while a grammar's sample is pending (the
        executor may defer it: its last token is then computed again, so no step may be planned on it)."""
        if self.num_pending_samples and (
                self.structured or len(self.output_token_ids) + self.num_pending_samples >= self.max_output_tokens):
            return 0
        return self.num_tokens + self.num_pending_samples - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    def add_prompt_logprobs(self, run: PromptLogprobs) -> None:
        """Keeps the part of the run past what the request has: a recompute sends some of them again."""
        wanted = 1 + len(self.prompt_logprobs)  # the position of the next one
        if run.start_position <= wanted:
            self.prompt_logprobs.extend(run.tokens[wanted - run.start_position:])

    def append_token(self, token: SampledToken) -> None:
        """Adds a sampled token and decides whether the request has finished."""
        self.output_token_ids.append(token.token_id)
        self.num_tokens += 1
        if self.sampling_params.logprobs is not None:
            self.output_logprobs.append(token)
        num_output = len(self.output_token_ids)
        if token.token_id in self.stop_ids and num_output >= self.sampling_params.min_tokens:
            self.finish_reason = "stop"
        elif num_output >= self.max_output_tokens:
            self.finish_reason = "length"
