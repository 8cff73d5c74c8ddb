"""Conversions between the step messages of ``pagedserve.step`` and their protobuf forms.

Only servers and clients call these; the cores below them see plain Python objects.
"""
from __future__ import annotations

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import (
    BlockRequest,
    BlockTransfer,
    BlockStepRequest,
    BlockStepResult,
    ExecuteRequest,
    ExecuteResult,
    ExecuteStep,
    PromptLogprobs,
    RequestOutput,
    SampledToken,
    join_outputs,
)
from pagedserve.v1 import common_pb2, executor_pb2, kvcache_pb2, scheduler_pb2

FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
    "overloaded": common_pb2.FINISH_REASON_OVERLOADED,
    "unavailable": common_pb2.FINISH_REASON_UNAVAILABLE,
}
FINISH_REASON_NAMES = {value: name for name, value in FINISH_REASONS.items()}


# --------------------------------------------------------------------------- sampling parameters


def sampling_to_proto(params: SamplingParams, out: common_pb2.SamplingParams | None = None) -> common_pb2.SamplingParams:
    """What the scheduler and the executor use. Stop strings and the other text options stay behind:
    they apply where token ids become text (``pagedserve.output``), which the back end never sees."""
    out = common_pb2.SamplingParams() if out is None else out
    out.temperature = params.temperature
    out.top_p = params.top_p
    out.top_k = params.top_k
    out.min_p = params.min_p
    if params.seed is not None:  # an unsigned one as the int64 of the same bits, all the sampler reads
        out.seed = params.seed - (1 << 64) if params.seed >= 1 << 63 else params.seed
    if params.max_tokens is not None:
        out.max_tokens = params.max_tokens
    out.min_tokens = params.min_tokens
    out.stop_token_ids[:] = params.stop_token_ids
    out.ignore_eos = params.ignore_eos
    if params.logprobs is not None:
        out.logprobs = params.logprobs
    out.presence_penalty = params.presence_penalty
    out.frequency_penalty = params.frequency_penalty
    if params.repetition_penalty != 1.0:
        out.repetition_penalty = params.repetition_penalty
    out.logit_bias.clear()
    out.logit_bias.update(params.logit_bias)
    if params.json_schema is not None:
        out.json_schema = params.json_schema
    out.json_object = params.json_object
    if params.regex is not None:
        out.regex = params.regex
    if params.grammar is not None:
        out.grammar = params.grammar
    out.choice[:] = params.choice or []
    out.allowed_token_ids[:] = params.allowed_token_ids or []
    del out.bad_words_token_ids[:]
    for ids in params.bad_words_token_ids:
        out.bad_words_token_ids.add().ids[:] = ids
    if params.n != 1:
        out.n = params.n
    if params.prompt_logprobs is not None:
        out.prompt_logprobs = params.prompt_logprobs
    return out


def sampling_from_proto(message: common_pb2.SamplingParams, default_max_tokens: int | None = 16) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; raises ValueError naming a bad field."""
    fields = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "repetition_penalty", "json_schema",
                 "n", "prompt_logprobs", "regex", "grammar"):
        if message.HasField(name):
            fields[name] = getattr(message, name)
    fields["max_tokens"] = message.max_tokens if message.HasField("max_tokens") else default_max_tokens
    return SamplingParams(
        **fields,
        min_tokens=message.min_tokens,
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        logit_bias=dict(message.logit_bias),
        json_object=message.json_object,
        choice=list(message.choice) or None,
        allowed_token_ids=list(message.allowed_token_ids) or None,
        bad_words_token_ids=[list(sequence.ids) for sequence in message.bad_words_token_ids],
    )


def token_to_proto(token: SampledToken, out: common_pb2.TokenLogprob) -> common_pb2.TokenLogprob:
    out.token_id = token.token_id
    if token.logprob is not None:
        out.logprob = token.logprob
        out.top_token_ids[:] = token.top_token_ids or []
        out.top_logprobs[:] = token.top_logprobs or []
    if token.rank is not None:
        out.rank = token.rank
    return out


def token_from_proto(message: common_pb2.TokenLogprob) -> SampledToken:
    if not message.HasField("logprob"):
        return SampledToken(message.token_id)
    return SampledToken(
        message.token_id, message.logprob, list(message.top_token_ids), list(message.top_logprobs),
        message.rank if message.HasField("rank") else None,
    )


def _transfers_to_proto(transfers: list[BlockTransfer], out) -> None:
    for t in transfers:
        out.add(block_id=t.block_id, block_hash=t.block_hash, num_tokens=t.num_tokens)


def _transfers_from_proto(messages) -> list[BlockTransfer]:
    return [BlockTransfer(m.block_id, m.block_hash, m.num_tokens) for m in messages]


# --------------------------------------------------------------------------- scheduler <-> block manager


def block_step_request_to_proto(request: BlockStepRequest) -> kvcache_pb2.BlockStepRequest:
    out = kvcache_pb2.BlockStepRequest(
        scheduler_id=request.scheduler_id, executor_epoch=request.executor_epoch, step_id=request.step_id,
        executed_step_ids=request.executed_step_ids, failed_request_ids=request.failed_request_ids,
        planned_step_id=request.planned_step_id,
        free_request_ids=request.free_request_ids, lookahead_slots=request.lookahead_slots,
    )
    running, columns = request.running, out.running
    columns.request_ids[:] = [r.request_id for r in running]
    columns.num_tokens[:] = [r.num_tokens for r in running]
    columns.num_new_tokens[:] = [len(r.new_token_ids) if r.new_token_ids else 0 for r in running]
    columns.new_tokens_starts[:] = [r.new_tokens_start for r in running]
    columns.new_token_ids[:] = [t for r in running if r.new_token_ids for t in r.new_token_ids]
    if any(r.executor_id for r in running):
        index = {address: i for i, address in enumerate(dict.fromkeys(r.executor_id for r in running))}
        columns.executors[:] = list(index)
        columns.executor_indexes[:] = [index[r.executor_id] for r in running]
    for r in request.waiting:
        out.waiting.add(request_id=r.request_id, num_tokens=r.num_tokens, prompt_token_ids=r.prompt_token_ids,
                        cache_salt=r.cache_salt or "")
    return out


def block_step_request_from_proto(message: kvcache_pb2.BlockStepRequest) -> BlockStepRequest:
    """Raises ValueError when the running requests' arrays do not line up, or lookahead_slots is negative."""
    if message.lookahead_slots < 0:
        raise ValueError(f"lookahead_slots must be at least 0, got {message.lookahead_slots}")
    return BlockStepRequest(
        scheduler_id=message.scheduler_id,
        executor_epoch=message.executor_epoch,
        step_id=message.step_id,
        executed_step_ids=list(message.executed_step_ids),
        failed_request_ids=list(message.failed_request_ids),
        planned_step_id=message.planned_step_id,
        free_request_ids=list(message.free_request_ids),
        running=_running_from_proto(message.running),
        waiting=[BlockRequest(r.request_id, r.num_tokens, prompt_token_ids=list(r.prompt_token_ids),
                              cache_salt=r.cache_salt or None)
                 for r in message.waiting],
        lookahead_slots=message.lookahead_slots,
    )


def _running_from_proto(columns: kvcache_pb2.RunningRequests) -> list[BlockRequest]:
    ids, counts, tokens = columns.request_ids, list(columns.num_new_tokens), list(columns.new_token_ids)
    if not len(ids) == len(columns.num_tokens) == len(counts) == len(columns.new_tokens_starts):
        raise ValueError(f"running: {len(ids)} request_ids, {len(columns.num_tokens)} num_tokens, {len(counts)} "
                         f"num_new_tokens and {len(columns.new_tokens_starts)} new_tokens_starts must be as many")
    indexes = list(columns.executor_indexes)
    if indexes and len(indexes) != len(ids):
        raise ValueError(f"running: executor_indexes must be none or one per request ({len(ids)}), got {len(indexes)}")
    if indexes and not 0 <= min(indexes) <= max(indexes) < len(columns.executors):
        raise ValueError(f"running: executor_indexes must index the {len(columns.executors)} executors")
    executor_ids = [columns.executors[i] for i in indexes] if indexes else [""] * len(ids)
    if (counts and min(counts) < 0) or sum(counts) != len(tokens):
        raise ValueError(f"running: num_new_tokens must count the {len(tokens)} new_token_ids")
    running, at = [], 0
    # Every running request comes through here every step: positional arguments, and the columns as lists.
    for request_id, num_tokens, count, start, executor_id in zip(list(ids), list(columns.num_tokens), counts,
                                                                 list(columns.new_tokens_starts), executor_ids):
        running.append(BlockRequest(request_id, num_tokens, None, None, tokens[at:at + count] if count else None,
                                    start, executor_id))
        at += count
    return running


def block_step_result_to_proto(result: BlockStepResult) -> kvcache_pb2.BlockStepResult:
    """Only the deltas that add blocks travel: a running request served without new blocks (most of them,
    most steps) needs none, and an admitted request always gets blocks."""
    out = kvcache_pb2.BlockStepResult(preempted_request_ids=result.preempted_request_ids,
                                      swap_free=result.swap_free, executor_epoch=result.executor_epoch)
    for request_id, block_ids in result.new_block_ids.items():
        if not block_ids:
            continue
        delta = out.deltas[request_id]
        delta.block_ids[:] = block_ids
        delta.num_cached_tokens = result.num_cached_tokens.get(request_id, 0)
        delta.num_slots = result.num_slots[request_id]
        _transfers_to_proto(result.tier_loads.get(request_id, []), delta.tier_loads)
    _transfers_to_proto(result.saves_before, out.saves_before)
    _transfers_to_proto(result.saves_after, out.saves_after)
    _transfers_to_proto(result.swap_out, out.swap_out)
    return out


def block_step_results_to_proto(results: dict[str, BlockStepResult]) -> kvcache_pb2.BlockStepResults:
    """Per executor address."""
    out = kvcache_pb2.BlockStepResults()
    for address, result in results.items():
        out.executors[address].CopyFrom(block_step_result_to_proto(result))
    return out


def block_step_results_from_proto(message: kvcache_pb2.BlockStepResults) -> dict[str, BlockStepResult]:
    return {address: block_step_result_from_proto(result) for address, result in message.executors.items()}


def block_step_result_from_proto(message: kvcache_pb2.BlockStepResult) -> BlockStepResult:
    return BlockStepResult(
        new_block_ids={rid: list(d.block_ids) for rid, d in message.deltas.items()},
        num_cached_tokens={rid: d.num_cached_tokens for rid, d in message.deltas.items()},
        num_slots={rid: d.num_slots for rid, d in message.deltas.items()},
        preempted_request_ids=list(message.preempted_request_ids),
        tier_loads={rid: _transfers_from_proto(d.tier_loads) for rid, d in message.deltas.items() if d.tier_loads},
        saves_before=_transfers_from_proto(message.saves_before),
        saves_after=_transfers_from_proto(message.saves_after),
        swap_out=_transfers_from_proto(message.swap_out),
        swap_free=list(message.swap_free),
        executor_epoch=message.executor_epoch,
    )


# --------------------------------------------------------------------------- scheduler <-> executor


# In DecodeRows.token_ids: the token the executor sampled for the request in its previous step.
FEED_SAMPLED = -1


def _is_decode_row(r: ExecuteRequest) -> bool:
    """A row that DecodeRows can carry: a request whose state the executor holds, computing one token."""
    return (r.sample and r.sampling_params is None and not r.load_blocks and not r.prompt_logprobs
            and len(r.token_ids) + r.feed_sampled == 1)


def execute_step_to_proto(step: ExecuteStep) -> executor_pb2.ExecuteStep:
    out = executor_pb2.ExecuteStep(
        finished_request_ids=step.finished_request_ids, executor_epoch=step.executor_epoch,
        scheduler_id=step.scheduler_id, step_id=step.step_id, swap_free=step.swap_free,
    )
    _transfers_to_proto(step.save_blocks, out.save_blocks)
    _transfers_to_proto(step.save_blocks_after, out.save_blocks_after)
    _transfers_to_proto(step.swap_out, out.swap_out)
    ids, positions, tokens, block_rows, block_ids = [], [], [], [], []
    for r in step.requests:
        if _is_decode_row(r):
            if r.new_block_ids:
                block_rows += [len(ids)] * len(r.new_block_ids)
                block_ids += r.new_block_ids
            ids.append(r.request_id)
            positions.append(r.start_position)
            tokens.append(FEED_SAMPLED if r.feed_sampled else r.token_ids[0])
            continue
        item = out.requests.add(
            request_id=r.request_id, token_ids=r.token_ids, start_position=r.start_position,
            new_block_ids=r.new_block_ids, sample=r.sample, feed_sampled=r.feed_sampled,
            prompt_logprobs=r.prompt_logprobs,
        )
        if r.sampling_params is not None:
            sampling_to_proto(r.sampling_params, item.sampling)
            item.prompt_len = r.prompt_len
            item.prefix_token_ids[:] = r.prefix_token_ids
        _transfers_to_proto(r.load_blocks, item.load_blocks)
    if ids:
        decodes = out.decodes
        decodes.request_ids[:] = ids
        decodes.positions[:] = positions
        decodes.token_ids[:] = tokens
        decodes.block_rows[:] = block_rows
        decodes.block_ids[:] = block_ids
    return out


def execute_step_from_proto(message: executor_pb2.ExecuteStep) -> tuple[ExecuteStep, dict[str, str]]:
    """The step, less any request whose sampling parameters are invalid: those come back as
    {request id: reason}, so that one bad request fails alone. Raises ValueError for DecodeRows whose
    arrays do not line up."""
    requests, rejected = [], {}
    for r in message.requests:
        try:
            params = sampling_from_proto(r.sampling, None) if r.HasField("sampling") else None
        except ValueError as error:
            rejected[r.request_id] = f"invalid sampling parameters: {error}"
            continue
        requests.append(ExecuteRequest(
            request_id=r.request_id,
            token_ids=list(r.token_ids),
            start_position=r.start_position,
            new_block_ids=list(r.new_block_ids),
            sample=r.sample,
            sampling_params=params,
            prompt_len=r.prompt_len,
            load_blocks=_transfers_from_proto(r.load_blocks),
            prefix_token_ids=list(r.prefix_token_ids),
            feed_sampled=r.feed_sampled,
            prompt_logprobs=r.prompt_logprobs,
        ))
    requests += _decode_rows_from_proto(message.decodes)
    step = ExecuteStep(
        requests=requests,
        finished_request_ids=list(message.finished_request_ids),
        executor_epoch=message.executor_epoch,
        scheduler_id=message.scheduler_id,
        save_blocks=_transfers_from_proto(message.save_blocks),
        save_blocks_after=_transfers_from_proto(message.save_blocks_after),
        step_id=message.step_id,
        swap_out=_transfers_from_proto(message.swap_out),
        swap_free=list(message.swap_free),
    )
    return step, rejected


def _decode_rows_from_proto(decodes: executor_pb2.DecodeRows) -> list[ExecuteRequest]:
    ids = decodes.request_ids
    if not len(decodes.positions) == len(decodes.token_ids) == len(ids):
        raise ValueError(f"decodes: {len(ids)} request_ids, {len(decodes.positions)} positions and "
                         f"{len(decodes.token_ids)} token_ids must be as many")
    if len(decodes.block_rows) != len(decodes.block_ids):
        raise ValueError(f"decodes: {len(decodes.block_rows)} block_rows for {len(decodes.block_ids)} block_ids")
    new_blocks: dict[int, list[int]] = {}
    for row, block_id in zip(decodes.block_rows, decodes.block_ids):
        if not 0 <= row < len(ids):
            raise ValueError(f"decodes: block_rows names row {row} of {len(ids)}")
        new_blocks.setdefault(row, []).append(block_id)
    # Every running request comes through here every step: the columns as lists, positional arguments.
    return [
        ExecuteRequest(request_id, [] if token == FEED_SAMPLED else [token], position,
                       new_blocks.get(row, []) if new_blocks else [], True, None, 0, [], [], token == FEED_SAMPLED)
        for row, (request_id, position, token) in enumerate(zip(list(ids), list(decodes.positions),
                                                                list(decodes.token_ids)))
    ]


def execute_result_to_proto(result: ExecuteResult) -> executor_pb2.ExecuteResult:
    out = executor_pb2.ExecuteResult(
        num_prefill_tokens=result.num_prefill_tokens, num_decode_tokens=result.num_decode_tokens,
        num_loaded_blocks=result.num_loaded_blocks, num_failed_loads=result.num_failed_loads,
        rejected=result.rejected, deferred=result.deferred,
    )
    sampled = result.sampled
    out.sampled_request_ids[:] = list(sampled)
    out.sampled_token_ids[:] = [token.token_id for token in sampled.values()]
    for request_id, token in sampled.items():
        if token.logprob is not None:
            token_to_proto(token, out.sampled_logprobs[request_id])
    for request_id, run in result.prompt_logprobs.items():
        entry = out.prompt_logprobs[request_id]
        entry.start_position = run.start_position
        for token in run.tokens:
            token_to_proto(token, entry.tokens.add())
    return out


def execute_result_from_proto(message: executor_pb2.ExecuteResult) -> ExecuteResult:
    sampled = {request_id: SampledToken(token_id)
               for request_id, token_id in zip(message.sampled_request_ids, message.sampled_token_ids)}
    for request_id, token in message.sampled_logprobs.items():
        sampled[request_id] = token_from_proto(token)
    return ExecuteResult(
        sampled=sampled,
        num_prefill_tokens=message.num_prefill_tokens,
        num_decode_tokens=message.num_decode_tokens,
        num_loaded_blocks=message.num_loaded_blocks,
        num_failed_loads=message.num_failed_loads,
        rejected=dict(message.rejected),
        prompt_logprobs={rid: PromptLogprobs(run.start_position, [token_from_proto(t) for t in run.tokens])
                         for rid, run in message.prompt_logprobs.items()},
        deferred=list(message.deferred),
    )


# --------------------------------------------------------------------------- scheduler -> frontend


def request_output_from_proto(message: scheduler_pb2.RequestOutput) -> RequestOutput:
    logprobs, prompt_logprobs = message.logprobs, message.prompt_logprobs
    return RequestOutput(
        message.request_id, list(message.new_token_ids),
        [token_from_proto(t) for t in logprobs] if logprobs else None,
        FINISH_REASON_NAMES[message.finish_reason], message.num_prompt_tokens, message.num_output_tokens,
        message.error or None,
        [token_from_proto(t) for t in prompt_logprobs] if prompt_logprobs else None,
        message.queue_time_s if message.HasField("queue_time_s") else None,
        message.prefill_time_s if message.HasField("prefill_time_s") else None,
    )


def request_output_to_proto(output: RequestOutput, out: scheduler_pb2.RequestOutput) -> scheduler_pb2.RequestOutput:
    """Fills `out`, a new message (as `outputs.add()` gives): fields at their defaults are left unset."""
    out.request_id = output.request_id
    out.new_token_ids.extend(output.new_token_ids)
    if output.new_logprobs:
        for token in output.new_logprobs:
            token_to_proto(token, out.logprobs.add())
    if output.finish_reason is not None:
        out.finish_reason = FINISH_REASONS[output.finish_reason]
    out.num_prompt_tokens = output.num_prompt_tokens
    out.num_output_tokens = output.num_output_tokens
    if output.error:
        out.error = output.error
    if output.prompt_logprobs:
        for token in output.prompt_logprobs:
            token_to_proto(token, out.prompt_logprobs.add())
    if output.queue_time_s is not None:
        out.queue_time_s, out.prefill_time_s = output.queue_time_s, output.prefill_time_s
    return out


def scheduler_update_to_proto(outputs: list[RequestOutput]) -> scheduler_pb2.SchedulerUpdate:
    """One update for the outputs of one or more steps, a request's joined into one. Every token of every
    request comes through here: those that carry only tokens go as columns (TokenOutputs)."""
    update = scheduler_pb2.SchedulerUpdate()
    plain = []
    for output in join_outputs(outputs):
        if (output.finish_reason is None and output.new_logprobs is None and output.prompt_logprobs is None
                and not output.error and output.queue_time_s is None):
            plain.append(output)
        else:
            request_output_to_proto(output, update.outputs.add())
    if plain:
        columns = update.tokens
        columns.request_ids[:] = [o.request_id for o in plain]
        columns.num_new_tokens[:] = [len(o.new_token_ids) for o in plain]
        columns.new_token_ids[:] = [t for o in plain for t in o.new_token_ids]
        columns.num_prompt_tokens[:] = [o.num_prompt_tokens for o in plain]
        columns.num_output_tokens[:] = [o.num_output_tokens for o in plain]
    return update


def scheduler_update_from_proto(message: scheduler_pb2.SchedulerUpdate) -> list[RequestOutput]:
    """Raises ValueError when the token columns do not line up."""
    outputs = [request_output_from_proto(m) for m in message.outputs]
    columns = message.tokens
    ids, counts, tokens = columns.request_ids, list(columns.num_new_tokens), list(columns.new_token_ids)
    if not len(ids) == len(counts) == len(columns.num_prompt_tokens) == len(columns.num_output_tokens):
        raise ValueError(f"tokens: {len(ids)} request_ids, {len(counts)} num_new_tokens, "
                         f"{len(columns.num_prompt_tokens)} num_prompt_tokens and {len(columns.num_output_tokens)} "
                         "num_output_tokens must be as many")
    if (counts and min(counts) < 0) or sum(counts) != len(tokens):
        raise ValueError(f"tokens: num_new_tokens must count the {len(tokens)} new_token_ids")
    at = 0
    for request_id, count, num_prompt, num_output in zip(ids, counts, columns.num_prompt_tokens,
                                                         columns.num_output_tokens):
        outputs.append(RequestOutput(request_id, tokens[at:at + count], None, None, num_prompt, num_output))
        at += count
    return outputs
