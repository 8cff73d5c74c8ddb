"""The messages of one engine step, as plain Python.

The scheduler produces them, the KV-cache block manager and the executor consume them. In one process they
are passed as they are; between processes each server converts them to and from protobuf. Keeping them
here, in the shared foundation, is what lets the three cores meet without importing each other.

A step costs one call to the block manager (``BlockStepRequest`` -> ``BlockStepResult``) and one call to
the executor (``ExecuteStep`` -> ``ExecuteResult``), whatever the batch size.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams


# --------------------------------------------------------------------------- scheduler -> block manager


@dataclass(slots=True)
class BlockRequest:
    """One candidate of a step: a running request to grow, or a waiting request to admit."""

    request_id: str
    # Running: tokens that must have a KV slot once this step has run (computed so far + scheduled now;
    # its current count when the budget left it nothing this step). Waiting: tokens to compute this step,
    # counted from the end of whatever prefix the block manager finds already cached.
    num_tokens: int
    # Waiting only: its known tokens (prompt, and after a preemption the outputs so far), which the
    # prefix cache hashes to find blocks that are already computed.
    prompt_token_ids: list[int] | None = None
    cache_salt: str | None = None
    # Running only: tokens it gained since the block manager last heard of it (sampled ones), so that it
    # can name the blocks they fill, and the position of the first (sending them twice changes nothing).
    new_token_ids: list[int] | None = None
    new_tokens_start: int = 0
    # Running only: the address of the executor it lives on (none: the only one).
    executor_id: str = ""


@dataclass(slots=True)
class BlockTransfer:
    """A block's K/V moving between the KV pool and host memory (the offload tier, or the swap space of a
    preempted request), named by its prefix hash."""

    block_id: int
    block_hash: bytes
    # A load of a preempted request's last, partial block: its leading slots that hold K/V (0: all of them).
    num_tokens: int = 0


def num_loaded_tokens(loads: list[BlockTransfer], block_size: int) -> int:
    """The tokens these loads fill, from the first: every block's, a partial one's leading num_tokens."""
    return sum(load.num_tokens or block_size for load in loads)


@dataclass(slots=True)
class BlockStepRequest:
    # Who plans the steps, and for which executor: when either changes (a restart, a replacement), the
    # block manager drops the old one's requests, and on a new executor every block it had indexed, since
    # that KV is gone, before serving this step.
    scheduler_id: str = ""
    executor_epoch: str = ""
    # Numbers this step. A full block enters the prefix index only once the executor has computed it: the
    # blocks a call filled are indexed when a later call lists its step among executed_step_ids (the steps
    # whose results the scheduler received since its last call; with steps planned ahead, that is a step or
    # two behind), except those of failed_request_ids (requests whose part of them did not run). A call
    # at or before the last executed step that is not among them never ran: its blocks are forgotten.
    step_id: int = 0
    executed_step_ids: list[int] = field(default_factory=list)
    # The last step whose answer the scheduler received: block ids handed out after it are sent again.
    planned_step_id: int = 0
    failed_request_ids: list[str] = field(default_factory=list)
    # Requests that ended (finished, aborted, failed, or preempted by the scheduler) since the last step;
    # freed first.
    free_request_ids: list[str] = field(default_factory=list)
    # Every running request, highest priority first: served in this order, and preempted from the tail.
    running: list[BlockRequest] = field(default_factory=list)
    # Waiting requests to admit, in order, while nobody was preempted and each fits.
    waiting: list[BlockRequest] = field(default_factory=list)
    # Slots to reserve ahead: once the step is served, each running request gets blocks for this many slots
    # past what it needs, while the pool has a quarter of its blocks to spare, so that the scheduler can plan
    # the next steps without a call until one of them runs out (see BlockStepResult.num_slots).
    lookahead_slots: int = 0


@dataclass(slots=True)
class BlockStepResult:
    # Per served request: block ids appended to its table this step (a delta, not the table; on
    # admission, the whole table). A waiting request is admitted exactly when it has an entry.
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # For admitted requests: leading known tokens whose KV is already computed (pool or tier).
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    # Running requests that gave all their blocks back this step, in the order taken (newest first).
    preempted_request_ids: list[str] = field(default_factory=list)
    # Per admitted request: blocks (right after its pool hits) to fill from host memory, its own swapped
    # copies first, then the offload tier; they are counted in num_cached_tokens.
    tier_loads: dict[str, list[BlockTransfer]] = field(default_factory=dict)
    # Cached blocks this step hands to other tokens: copied out before the step overwrites them.
    saves_before: list[BlockTransfer] = field(default_factory=list)
    # Blocks this step fills, copied out after it (write-through, when asked for).
    saves_after: list[BlockTransfer] = field(default_factory=list)
    # Preemption by swap: blocks of the requests preempted this step, copied to the swap space before the
    # step overwrites them; and the swap-space copies that are no longer needed.
    swap_out: list[BlockTransfer] = field(default_factory=list)
    swap_free: list[bytes] = field(default_factory=list)
    # The executor instance whose pool served this answer (several executors: each has its own).
    executor_epoch: str = ""
    # Per request whose table grew this step (admitted ones included): the slots its whole table holds.
    num_slots: dict[str, int] = field(default_factory=dict)


def one_executor(step: Callable[[BlockStepRequest], BlockStepResult]) -> Callable[[BlockStepRequest],
                                                                                   dict[str, BlockStepResult]]:
    """A block manager of one executor's pool, answering as the KV-cache service does (per executor address)
    under the empty address: what the scheduler's allocate_blocks takes."""
    return lambda request: {"": step(request)}


# --------------------------------------------------------------------------- scheduler -> executor


@dataclass(slots=True)
class ExecuteRequest:
    request_id: str
    # Tokens whose K/V this step computes: a prefill chunk, or the one newest token of a decode (unless
    # feed_sampled stands for it).
    token_ids: list[int]
    # Position of token_ids[0]; every earlier position's K/V is already in the cache.
    start_position: int
    # Appended to the block table the executor keeps for this request.
    new_block_ids: list[int]
    # True when the row ends at the request's last token, so the step samples its next one.
    sample: bool
    # Sent the first time the executor sees the request (and again after preemption); the executor
    # then (re)creates its state, so its block table starts from new_block_ids alone.
    sampling_params: SamplingParams | None = None
    # Sent with sampling_params: the prompt length, from which the executor counts output tokens
    # (min_tokens keeps stop and EOS tokens from being sampled until that many exist).
    prompt_len: int = 0
    # Blocks to fill from host memory (swap space or offload tier) before computing: they hold the first
    # num_loaded_tokens(load_blocks) of token_ids, which are computed only if a load fails.
    load_blocks: list[BlockTransfer] = field(default_factory=list)
    # Sent with sampling_params when the sampling follows every token (sampling_params.needs_token_history):
    # the tokens before start_position, which the executor does not compute (a cached prefix).
    prefix_token_ids: list[int] = field(default_factory=list)
    # The row computes one more token after token_ids: the one the executor sampled for this request in its
    # previous step, which the scheduler planned this step without knowing (steps planned ahead).
    feed_sampled: bool = False
    # Return the logprobs of the prompt tokens this step computes (sampling_params.prompt_logprobs): the
    # scheduler asks while the request still lacks some.
    prompt_logprobs: bool = False


@dataclass(slots=True)
class ExecuteStep:
    requests: list[ExecuteRequest] = field(default_factory=list)
    # The executor instance the step was planned for: another one (restarted, replacing it) holds none of
    # the KV the plan assumes, and refuses the step.
    executor_epoch: str = ""
    # A new scheduler means the old one's requests are gone: the executor drops their state.
    scheduler_id: str = ""
    # Requests whose state the executor drops before running this step (finished, aborted, preempted).
    finished_request_ids: list[str] = field(default_factory=list)
    # Copied to the offload tier before the step runs, and after it.
    save_blocks: list[BlockTransfer] = field(default_factory=list)
    save_blocks_after: list[BlockTransfer] = field(default_factory=list)
    # The scheduler's number for the step (the block manager's for the same plan).
    step_id: int = 0
    # Copied to the swap space before the step runs (before anything writes the pool); and swap-space copies
    # released once the step's loads are done (see BlockStepResult).
    swap_out: list[BlockTransfer] = field(default_factory=list)
    swap_free: list[bytes] = field(default_factory=list)
    # The executor (its address) the step goes to; "" when there is only one. (Not sent: the channel says it.)
    executor_id: str = ""
    # A step over several executors: its part for each (requests holds every row, in the order planned, and
    # the other fields are the parts'). Empty: the step is for one executor.
    parts: list["ExecuteStep"] = field(default_factory=list)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # log-probability of token_id under the model's distribution
    top_token_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    rank: int | None = None  # of token_id in the distribution, 1 for the most likely (prompt logprobs)


@dataclass(slots=True)
class PromptLogprobs:
    """The logprobs of a run of prompt tokens: tokens[i] is the prompt token at start_position + i (at least 1:
    the first token of a prompt has no logprob)."""

    start_position: int
    tokens: list[SampledToken] = field(default_factory=list)


@dataclass(slots=True)
class ExecuteResult:
    # One entry per request of the step that had sample=True.
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_loaded_blocks: int = 0  # filled from the offload tier
    num_failed_loads: int = 0  # missing from the tier: their tokens were computed instead
    # Requests refused before anything ran (invalid token ids, block ids, positions), with the reason;
    # the rest of the step ran without them.
    rejected: dict[str, str] = field(default_factory=dict)
    # Per request that asked (ExecuteRequest.prompt_logprobs): the logprobs of the prompt tokens it computed.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Requests that reached their sampling position but were not sampled, their grammar still compiling: their
    # last token is computed again in a later step, which samples them.
    deferred: list[str] = field(default_factory=list)


def merge_results(results: list[ExecuteResult]) -> ExecuteResult:
    """The results of a step's parts (one per executor) as the step's."""
    merged = ExecuteResult()
    for result in results:
        merged.sampled.update(result.sampled)
        merged.num_prefill_tokens += result.num_prefill_tokens
        merged.num_decode_tokens += result.num_decode_tokens
        merged.num_loaded_blocks += result.num_loaded_blocks
        merged.num_failed_loads += result.num_failed_loads
        merged.rejected.update(result.rejected)
        merged.prompt_logprobs.update(result.prompt_logprobs)
        merged.deferred.extend(result.deferred)
    return merged


# --------------------------------------------------------------------------- scheduler -> frontend


@dataclass(slots=True)
class RequestOutput:
    """What one step added to one request: its new tokens and, on the last one, why it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledToken] | None = None  # when the request asked for logprobs
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far, this step's included
    error: str | None = None  # with finish_reason "error", or "overloaded" or "unavailable" (refused at admission)
    # With sampling_params.prompt_logprobs, once: the logprobs of prompt tokens 1 to the end (the first has none).
    prompt_logprobs: list[SampledToken] | None = None
    # On a request's first output with a token, on the scheduler's clock: the seconds from its arrival to its
    # first scheduling (its wait in the queue), and from then to this output (its prompt's computation).
    queue_time_s: float | None = None
    prefill_time_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def join_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Each request's outputs of consecutive steps as one, in the order the requests first appear: its new
    tokens (and logprobs) in order, its prompt logprobs and queue and prefill times (sent once), the finish
    and counts of the last."""
    runs: dict[str, list[RequestOutput]] = {}
    for output in outputs:
        run = runs.get(output.request_id)
        if run is None:
            runs[output.request_id] = [output]
        else:
            run.append(output)
    # Most often (a step's outputs) every request appears once: the list as it came.
    return outputs if len(runs) == len(outputs) else [join_run(run) for run in runs.values()]


def join_run(run: list[RequestOutput]) -> RequestOutput:
    """One request's outputs of consecutive steps, oldest first, as one (see join_outputs)."""
    if len(run) == 1:
        return run[0]
    last = run[-1]
    logprobs = [token for output in run if output.new_logprobs for token in output.new_logprobs]
    timed = next((output for output in run if output.queue_time_s is not None), None)
    return RequestOutput(
        last.request_id, [token_id for output in run for token_id in output.new_token_ids], logprobs or None,
        last.finish_reason, last.num_prompt_tokens, last.num_output_tokens, last.error,
        next((output.prompt_logprobs for output in run if output.prompt_logprobs), None),
        timed.queue_time_s if timed else None, timed.prefill_time_s if timed else None,
    )
