"""Runs one engine step: flat batch in, one sampled token per finishing chunk out.

The runner keeps per-request state between steps (block table, sampling parameters, the token it sampled
last), so a steady-state decode step carries a few integers per request, and a step planned before the
scheduler knew the last sampled tokens has the runner feed them in itself. It owns the model, the KV
tensors and the sampler.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention.layout import BatchLayout
from executor_svc.attention.selection import select_attention_backend
from executor_svc import cuda_graphs
from executor_svc.kv_cache import allocate_kv_caches, kv_cache_budget, kv_cache_dtype, num_blocks_for_budget
from executor_svc.model_config import ModelArchitecture, parse_dtype
from executor_svc.model_loader import (
    generation_eos_token_ids,
    iterate_weights,
    model_fingerprint,
    resolve_model_dir,
)
from executor_svc.models.llama import LlamaForCausalLM
from executor_svc.costs import copy_bytes_per_s, prefill_tokens_per_s
from executor_svc.offload import HostTier, RedisTier, SwapSpace
from executor_svc.sampler import Sampler, SamplingBatch, TokenCounts
from executor_svc.structured_output import GrammarError, RequestGrammar, StructuredOutput
from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig, dtype_reason
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import (
    BlockTransfer, ExecuteRequest, ExecuteResult, ExecuteStep, PromptLogprobs, SampledToken, num_loaded_tokens,
)

logger = logging.getLogger(__name__)

# Prompt logprobs are computed over this many positions at a time: a [rows, vocab] float32 block each.
PROMPT_LOGPROBS_ROWS = 256


class StaleEpoch(Exception):
    """A step planned for another executor instance."""


@dataclass
class LaunchedStep:
    """A step the runner has launched: its host work is done, and result() hands its result over once the
    device has run it. Until ready_at (time.monotonic()) the device is busy with it, and the executor may
    launch the next step meanwhile. This runner's device is the host itself: its steps are done at launch."""
    outcome: ExecuteResult
    ready_at: float = 0.0

    def result(self) -> ExecuteResult:
        return self.outcome


@dataclass
class RequestState:
    params: SamplingParams
    block_ids: list[int]
    prompt_len: int
    grammar: RequestGrammar | None = None  # of a structured request
    # The token sampled for the request last, and the position it takes: what a row that feeds the
    # sampled token in (ExecuteRequest.feed_sampled) computes there.
    sampled_token: int = 0
    sampled_position: int = -1
    # Penalties and grammars have followed the tokens before this position (a deferred request computes its
    # last token again: it is not counted twice).
    num_followed: int = 0
    # Prompt logprobs: the log-softmax of the last position computed, whose next token starts the next chunk.
    prompt_logprobs_row: torch.Tensor | None = None
    follows_tokens: bool = dataclasses.field(init=False)  # params.needs_token_history, asked every step
    # With bad words: the output's last tokens, as many as the longest bad word's prefix.
    output_tail: list[int] = dataclasses.field(default_factory=list)
    output_tail_len: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.follows_tokens = self.params.needs_token_history
        self.output_tail_len = max((len(s) - 1 for s in self.params.bad_words_token_ids), default=0)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        offload_tier: HostTier | RedisTier | None = None,
    ) -> None:
        """scheduler_config: its max_num_seqs sizes the CPU KV cache and the CUDA graphs."""
        from transformers import AutoConfig

        requested_dtype = model_config.dtype
        model_config = model_config.resolved()
        cache_config = cache_config or CacheConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        self.model_config, self.cache_config = model_config, cache_config
        torch.manual_seed(model_config.seed)
        self.device = torch.device(model_config.device)
        self.dtype = parse_dtype(model_config.dtype)
        logger.info("dtype %s (%s)", model_config.dtype, dtype_reason(requested_dtype, model_config.device))
        # Attention runs in the K/V's dtype (the model casts its queries and keys to it, and the output back).
        self.kv_dtype = kv_cache_dtype(cache_config.kv_cache_dtype, self.dtype)
        if self.device.type == "cpu":
            torch.set_num_threads(model_config.cpu_threads or len(os.sched_getaffinity(0)))
            logger.info("%d torch threads", torch.get_num_threads())
        self.block_size = block_size = cache_config.block_size
        self.model_dir = resolve_model_dir(model_config.model)
        self.config = ModelArchitecture.from_hf_config(
            AutoConfig.from_pretrained(self.model_dir), model_config.max_model_len
        )
        self.eos_token_ids = tuple(
            sorted(set(self.config.eos_token_ids) | set(generation_eos_token_ids(self.model_dir)))
        )
        # What the K/V were computed with: prefix hashes (and so Redis keys) are rooted in it.
        self.model_id = f"{model_fingerprint(self.model_dir)}|{model_config.dtype}" + (
            f"|kv {cache_config.kv_cache_dtype}" if self.kv_dtype != self.dtype else "")

        backend_cls, reason = select_attention_backend(
            self.device, model_config.attention_backend, head_dim=self.config.head_dim, dtype=self.kv_dtype
        )
        self.attention_backend_name = backend_cls.name
        logger.info("attention backend %s (%s)", self.attention_backend_name, reason)
        self.attention = backend_cls(
            self.config.num_heads, self.config.num_kv_heads, self.config.head_dim, self.config.attention_scale
        )
        # The CPU kernels' extension fuses the decoder's elementwise steps too; with the torch backend the model
        # keeps torch's operators, the reference.
        fused_ops = self.attention.ops if self.attention_backend_name == "cpu" else None
        with torch.device(self.device):
            self.model = LlamaForCausalLM(self.config, self.attention, fused_ops)
        self.model.load_weights(iterate_weights(self.model_dir))
        self.model.convert(self.dtype)
        self.model.eval()
        if fused_ops is not None and self.dtype == torch.bfloat16:
            packed, plain = self.model.pack_bfloat16_linears()
            logger.info("linear layers: %d packed for oneDNN, %d plain", packed, plain)

        budget = kv_cache_budget(cache_config, self.device, self.config.kv_bytes_per_token(self.kv_dtype),
                                 self.config.max_model_len, scheduler_config.max_num_seqs)
        self.num_blocks = num_blocks_for_budget(self.config, self.kv_dtype, block_size, budget)
        self.kv_caches = allocate_kv_caches(self.config, self.num_blocks, block_size, self.kv_dtype, self.device)
        # A request alone must always fit in the pool, or preemption could never make room for it.
        self.max_model_len = min(self.config.max_model_len, self.num_blocks * block_size)
        if self.max_model_len < self.config.max_model_len:
            logger.warning("KV cache holds %d tokens; capping the context length at that", self.max_model_len)
        logger.info(
            "model %s (%s, %s) on %s; KV cache (%s) %d blocks x %d tokens (%.1f MiB)",
            self.model_dir, self.config.model_type, model_config.dtype, self.device,
            str(self.kv_dtype).removeprefix("torch."), self.num_blocks, block_size, budget / 2**20,
        )
        self.sampler = Sampler(fused_ops.argmax if fused_ops is not None else None)
        self._last_sampling_batch: tuple[list[SamplingParams], SamplingBatch] | None = None
        self.requests: dict[str, RequestState] = {}
        self.token_counts = TokenCounts(self.config.vocab_size, self.device)
        self.structured_output = StructuredOutput(self.model_dir, self.config.vocab_size, self.eos_token_ids)
        # This instance: a plan made for another one assumes KV this one never computed.
        self.epoch = uuid.uuid4().hex
        self.scheduler_id = ""  # whose requests self.requests holds
        self.offload_tier = offload_tier
        self.block_bytes = self.config.kv_bytes_per_token(self.kv_dtype) * block_size
        self.blocks_saved = self.blocks_loaded = self.failed_loads = 0
        self.bytes_saved = self.bytes_loaded = 0
        self.swap_space = SwapSpace(cache_config.swap_host_bytes)
        # What preempting a request costs either way, for the block manager's choice between recompute and swap.
        self.prefill_tokens_per_s = prefill_tokens_per_s(self.model)
        self.copy_bytes_per_s = copy_bytes_per_s(self._read_blocks, self._write_blocks, self.num_blocks,
                                                 self.block_bytes, self.device)
        logger.info("preemption costs: prefill %.0f tokens/s (linear layers), host copies %.2f GB/s",
                    self.prefill_tokens_per_s, self.copy_bytes_per_s / 1e9)
        # Tokens whose K/V this runner has computed since start (prefix-cache hits are not among them).
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        # Decode steps replay CUDA graphs (CUDA with the cupy backend only; see executor_svc/cuda_graphs.py).
        self.enforce_eager = model_config.enforce_eager
        self.cuda_graph_batch_sizes = cuda_graphs.cuda_graph_batch_sizes(
            scheduler_config.max_num_seqs, model_config.cuda_graph_batch_sizes
        )
        self.decode_graphs: cuda_graphs.DecodeGraphRunner | None = None
        self._capture_decode_graphs()

    @torch.inference_mode()
    def execute(self, step: ExecuteStep) -> ExecuteResult:
        """Runs the step. Raises StaleEpoch for a step planned for another executor instance; refuses (in
        result.rejected) the requests that would read or write outside what they own."""
        try:
            return self._execute(step)
        except StaleEpoch:
            raise
        except Exception:
            # The scheduler rolls the step back with the steps sent after it, and re-admits its requests; until
            # then their rows in those steps must not run on state (block tables) this step left half-updated
            # or that missed frees: unknown, they are refused.
            for req in step.requests:
                self._drop(req.request_id)
            raise

    def launch(self, step: ExecuteStep) -> LaunchedStep:
        """execute(), as the executor's step worker calls it (see LaunchedStep)."""
        return LaunchedStep(self.execute(step))

    def _execute(self, step: ExecuteStep) -> ExecuteResult:
        sampling, logits, result = self._run_model(step)
        sampling, logits = self._wait_for_grammars(step, sampling, logits, result)
        if not sampling:
            return result
        params = [self.requests[r.request_id].params for r in sampling]
        sampled_positions = [r.start_position + len(r.token_ids) for r in sampling]
        batch = self._sampling_batch(params)
        penalty_counts = None
        if batch.penalty_rows is not None:
            penalty_counts = self.token_counts.gather([r.request_id for r, p in zip(sampling, params) if p.has_penalties])
        grammar_mask = None
        # A grammar that has accepted its stop token constrains nothing more: its request has ended (with
        # steps planned ahead, this is a step planned before that was known; its token is dropped).
        grammar_rows = [row for row, r in enumerate(sampling) if (grammar := self.requests[r.request_id].grammar)
                        is not None and not grammar.matcher.is_terminated()]
        if grammar_rows:
            grammars = [self.requests[sampling[row].request_id].grammar for row in grammar_rows]
            grammar_mask = (self.structured_output.bitmask(len(sampling), grammar_rows, grammars), grammar_rows)
        banned = self._banned_tokens(sampling, sampled_positions)
        tokens = self.sampler(logits, batch, sampled_positions, penalty_counts, grammar_mask,
                              banned).to_sampled_tokens(batch)
        result.sampled = self._remember_samples(sampling, tokens)
        return result

    def _remember_samples(self, sampling: list[ExecuteRequest],
                          tokens: Iterable[SampledToken]) -> dict[str, SampledToken]:
        """Keeps each request's token for the row that feeds it in; returns them by request id (the result's
        sampled)."""
        states, sampled = self.requests, {}
        for req, token in zip(sampling, tokens):
            state = states[req.request_id]
            state.sampled_token, state.sampled_position = token.token_id, req.start_position + len(req.token_ids)
            sampled[req.request_id] = token
        return sampled

    def _wait_for_grammars(self, step: ExecuteStep, sampling: list[ExecuteRequest], logits, result: ExecuteResult):
        """The requests to sample, and their logits, less those whose grammar has not compiled yet: deferred
        while the step serves anyone else (who would otherwise wait for the compilation), waited for when it
        serves only them; and refused when their grammar did not compile."""
        pending = [r.request_id for r in sampling
                   if (grammar := self.requests[r.request_id].grammar) is not None and grammar.matcher is None]
        if not pending:
            return sampling, logits
        alone = len(pending) == len(step.requests)
        keep = []
        for row, req in enumerate(sampling):
            if req.request_id in pending:
                try:
                    if not self.requests[req.request_id].grammar.ready(req.request_id, wait=alone):
                        result.deferred.append(req.request_id)
                        continue
                except GrammarError as error:
                    result.rejected[req.request_id] = str(error)
                    self._drop(req.request_id)
                    continue
            keep.append(row)
        return [sampling[row] for row in keep], logits[keep]

    def _sampling_batch(self, params: list[SamplingParams]) -> SamplingBatch:
        """The step's SamplingBatch, rebuilt only when its rows' parameter objects (a request's, kept from its
        first step) change or move: a steady decode batch reuses its tensors."""
        last = self._last_sampling_batch
        if last is None or len(last[0]) != len(params) or any(a is not b for a, b in zip(last[0], params)):
            self._last_sampling_batch = last = (params, SamplingBatch.build(params, self.device))
        return last[1]

    def _banned_tokens(self, sampling, sampled_positions) -> tuple[list[int], list[int]] | None:
        """(rows, token ids) that each row may not sample: its stop tokens (EOS and stop_token_ids) until
        min_tokens are out, and the last token of each bad word whose other tokens end the output (vLLM's
        bad_words). None when no row has any."""
        rows, columns = [], []
        for row, (req, position) in enumerate(zip(sampling, sampled_positions)):
            state = self.requests[req.request_id]
            params = state.params
            banned = []
            if position - state.prompt_len < params.min_tokens:
                banned += params.stop_token_ids
                if not params.ignore_eos:
                    banned += self.eos_token_ids
            if params.bad_words_token_ids:
                tail, num_output = state.output_tail, position - state.prompt_len
                banned += [s[-1] for s in params.bad_words_token_ids
                           if len(s) - 1 <= num_output and (len(s) == 1 or tail[len(tail) - len(s) + 1:] == s[:-1])]
            rows += [row] * len(banned)
            columns += banned
        return (rows, columns) if rows else None

    @torch.inference_mode()
    def step_logits(self, step: ExecuteStep) -> dict[str, torch.Tensor]:
        """Runs the step like execute() but returns the float32 logits of each sampling request."""
        sampling, logits, _ = self._run_model(step)
        return {req.request_id: logits[row] for row, req in enumerate(sampling)}

    def _run_model(self, step: ExecuteStep) -> tuple[list[ExecuteRequest], torch.Tensor | None, ExecuteResult]:
        if step.executor_epoch and step.executor_epoch != self.epoch:
            raise StaleEpoch(f"the step was planned for executor {step.executor_epoch}, this is {self.epoch}")
        if step.scheduler_id != self.scheduler_id:
            self.requests.clear()  # a new scheduler: the old one's requests are gone
            self.token_counts.clear()
            self.scheduler_id = step.scheduler_id
        for request_id in step.finished_request_ids:
            self._drop(request_id)
        rejected: dict[str, str] = {}
        accepted, following, loading = [], [], False
        states, block_size, max_model_len = self.requests, self.block_size, self.max_model_len
        for req in step.requests:
            state = states.get(req.request_id)
            position = req.start_position
            if (req.feed_sampled and not req.token_ids and state is not None and state.sampled_position == position
                    and req.sampling_params is None and not req.load_blocks and not req.new_block_ids
                    and position < max_model_len and len(state.block_ids) * block_size > position):
                # Every running request comes here every step: a decode of this executor's own sample, on the
                # blocks it holds. (_feed_sampled and _check_extent, for this case alone.)
                req.token_ids = [state.sampled_token]
                req.feed_sampled = False
            else:
                if req.feed_sampled:
                    req, error = self._feed_sampled(req, state)
                else:
                    error = self._check(req, state)
                if error is None and req.sampling_params is not None:
                    error = self._new_state(req)
                    state = states.get(req.request_id)
                elif error is None and req.new_block_ids:
                    state.block_ids.extend(req.new_block_ids)
                if error is not None:
                    rejected[req.request_id] = error
                    continue
                loading = loading or bool(req.load_blocks)
            accepted.append(req)
            if state.follows_tokens:
                following.append(req)
        self._follow_tokens(following)
        # Blocks about to be overwritten leave first; then prefix blocks come back from host memory, after
        # which the swap space lets go of the copies the block manager no longer needs.
        self._save_blocks(step.save_blocks)
        self._swap_out(step.swap_out)
        requests, num_loaded, num_failed = self._load_blocks(accepted) if loading else (accepted, 0, 0)
        if self.swap_space is not None:
            self.swap_space.free(step.swap_free)
        sampling, logits, result = self._forward(requests, num_loaded, num_failed)
        # Only what the step computed goes to the tier: a failed step saves nothing.
        self._save_blocks(step.save_blocks_after)
        result.rejected = rejected
        return sampling, logits, result

    def _feed_sampled(self, req: ExecuteRequest, state: RequestState | None) -> tuple[ExecuteRequest, str | None]:
        """The row with the token it feeds in (the one sampled for it last), checked; or why it cannot run."""
        position = req.start_position + len(req.token_ids)
        if req.sampling_params is not None or state is None or state.sampled_position != position:
            return req, f"no token was sampled for position {position} (the step that samples it did not run here)"
        # Completed in place (every running request comes through here every step): the row now carries the
        # token itself. Its sender reads no more than whether it samples.
        had_tokens = bool(req.token_ids)
        req.token_ids = req.token_ids + [state.sampled_token] if had_tokens else [state.sampled_token]
        req.feed_sampled = False
        if had_tokens or req.load_blocks:
            return req, self._check(req, state)
        # A decode of this executor's own sample, where it was sampled: only where it ends is new.
        return req, self._check_extent(req, len(state.block_ids), position + 1)

    def _drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.token_counts.remove(request_id)

    def _new_state(self, req: ExecuteRequest) -> str | None:
        """(Re)creates the request's state (its grammar, if any, starts compiling); the reason it cannot run,
        or None."""
        self._drop(req.request_id)
        params = req.sampling_params
        grammar = self.structured_output.grammar(params) if params.structured else None
        if params.has_penalties:
            self.token_counts.add(req.request_id)
        self.requests[req.request_id] = RequestState(params, list(req.new_block_ids), req.prompt_len, grammar)
        return None

    def _follow_tokens(self, requests: list[ExecuteRequest]) -> None:
        """Feeds the step's tokens (and, for a new state, its uncomputed prefix) to the penalty counts and the
        grammars of the requests that have them, before anything samples; each token once."""
        count_ids, count_tokens, count_is_output = [], [], []
        for req in requests:
            state = self.requests[req.request_id]
            prefix = req.prefix_token_ids if req.sampling_params is not None else []
            start = req.start_position - len(prefix)
            tokens = prefix + req.token_ids
            seen = max(state.num_followed - start, 0)
            tokens, start = tokens[seen:], start + seen
            state.num_followed = max(state.num_followed, start + len(tokens))
            first_output = max(state.prompt_len - start, 0)
            if state.params.has_penalties:
                count_ids += [req.request_id] * len(tokens)
                count_tokens += tokens
                count_is_output += [i >= first_output for i in range(len(tokens))]
            if state.grammar is not None:
                state.grammar.follow(req.request_id, tokens[first_output:])
            if state.output_tail_len:
                state.output_tail = (state.output_tail + tokens[first_output:])[-state.output_tail_len:]
        self.token_counts.record(count_ids, count_tokens, count_is_output)

    def _check(self, req: ExecuteRequest, state: RequestState | None) -> str | None:
        """Why the request (whose state is `state`) cannot run (it would read or write outside what it owns),
        or None. Called for every row of every step: no list is built for it."""
        params, tokens, vocab_size = req.sampling_params, req.token_ids, self.config.vocab_size
        if params is None and state is None:
            return "unknown to the executor and carries no sampling parameters"
        if not tokens:
            return "no tokens to compute"
        if params is not None:
            try:
                params.check_token_ids(vocab_size)
                params.check_allowed_tokens(self.eos_token_ids)
            except ValueError as error:
                return str(error)
        prefix = req.prefix_token_ids
        if min(tokens) < 0 or max(tokens) >= vocab_size or (prefix and (min(prefix) < 0 or max(prefix) >= vocab_size)):
            return f"token ids must be in [0, {vocab_size})"
        end = req.start_position + len(tokens)
        if req.start_position < 0:
            return f"positions [{req.start_position}, {end}) outside [0, {self.max_model_len})"
        if any(not 0 <= t.block_id < self.num_blocks for t in req.load_blocks):
            return f"block ids must be in [0, {self.num_blocks})"
        if req.load_blocks:
            partial = [t.num_tokens for t in req.load_blocks]
            if any(not 0 <= n < self.block_size for n in partial) or any(partial[:-1]):
                return (f"load_blocks: num_tokens must be in [0, {self.block_size}), and only the last block "
                        "may be partial")
            if num_loaded_tokens(req.load_blocks, self.block_size) >= len(tokens):
                return "load_blocks leave no token to compute"
        return self._check_extent(req, len(state.block_ids) if params is None else 0, end)

    def _check_extent(self, req: ExecuteRequest, num_blocks_held: int, end: int) -> str | None:
        """Why the row, ending at position end, cannot run on the blocks it holds and gets, or None."""
        if end > self.max_model_len:
            return f"positions [{req.start_position}, {end}) outside [0, {self.max_model_len})"
        new_blocks, num_blocks = req.new_block_ids, self.num_blocks
        if new_blocks and (min(new_blocks) < 0 or max(new_blocks) >= num_blocks):
            return f"block ids must be in [0, {num_blocks})"
        num_held = len(new_blocks) + num_blocks_held
        if num_held * self.block_size < end:
            return f"{num_held} blocks cannot hold {end} positions"
        return None

    def _forward(self, requests: list[ExecuteRequest], num_loaded: int, num_failed: int):
        if not requests:
            return [], None, ExecuteResult(num_loaded_blocks=num_loaded, num_failed_loads=num_failed)

        # Prefill chunks first, then single-token rows sorted by context length for grouping.
        prefills = [r for r in requests if len(r.token_ids) > 1]
        singles = sorted((r for r in requests if len(r.token_ids) == 1), key=lambda r: r.start_position)
        ordered = prefills + singles
        input_ids, positions, slots = self._flatten(ordered)
        layout = BatchLayout(
            query_lens=[len(r.token_ids) for r in ordered],
            context_lens=[r.start_position + len(r.token_ids) for r in ordered],
            block_tables=[self.requests[r.request_id].block_ids for r in ordered],
            num_prefills=len(prefills),
            slot_mapping=slots,
            block_size=self.block_size,
        )
        hidden = self._compute_hidden(input_ids, positions, layout)
        result = ExecuteResult(
            num_prefill_tokens=layout.num_prefill_tokens,
            num_decode_tokens=input_ids.shape[0] - layout.num_prefill_tokens,
            num_loaded_blocks=num_loaded,
            num_failed_loads=num_failed,
        )
        self.num_prefill_tokens += result.num_prefill_tokens
        self.num_decode_tokens += result.num_decode_tokens
        row_ends = np.cumsum([len(r.token_ids) for r in ordered]) - 1
        for i, req in enumerate(ordered):
            if req.prompt_logprobs:
                end = int(row_ends[i]) + 1
                run = self._prompt_logprobs(req, hidden[end - len(req.token_ids):end])
                if run.tokens:
                    result.prompt_logprobs[req.request_id] = run
        sample_rows = [int(row_ends[i]) for i, r in enumerate(ordered) if r.sample]
        if not sample_rows:
            return [], None, result
        logits = self.model.compute_logits(hidden[torch.as_tensor(sample_rows, device=self.device)])
        return [r for r in ordered if r.sample], logits, result

    def _prompt_logprobs(self, req: ExecuteRequest, hidden: torch.Tensor) -> PromptLogprobs:
        """The logprobs of the prompt tokens that the request's rows (hidden) predict, and of its first token
        from the previous chunk's last row; keeps this chunk's last row when the prompt goes on past it."""
        state = self.requests[req.request_id]
        num_top = state.params.prompt_logprobs
        start, end = req.start_position, req.start_position + len(req.token_ids)
        blocks = []  # (log-softmax rows [k, V], the k tokens they predict)
        first_position = start + 1
        if state.prompt_logprobs_row is not None:
            blocks.append((state.prompt_logprobs_row, req.token_ids[:1]))
            first_position = start
        # Position p predicts the token at p + 1: within the chunk, up to the prompt's last token.
        num_inside = max(min(end, state.prompt_len) - start - 1, 0)
        for first in range(0, num_inside, PROMPT_LOGPROBS_ROWS):
            count = min(PROMPT_LOGPROBS_ROWS, num_inside - first)
            blocks.append((self.model.compute_logits(hidden[first:first + count]).log_softmax(dim=-1),
                           req.token_ids[first + 1:first + 1 + count]))
        state.prompt_logprobs_row = (self.model.compute_logits(hidden[-1:]).log_softmax(dim=-1)
                                     if end < state.prompt_len else None)
        tokens = []
        for rows, targets in blocks:
            chosen = rows.gather(1, torch.tensor(targets, device=rows.device).unsqueeze(1))
            ranks = ((rows > chosen).sum(dim=1) + 1).tolist()  # (vLLM's rank: 1 + the tokens more likely)
            top = rows.topk(num_top, dim=-1) if num_top else None
            top_ids = top.indices.tolist() if top is not None else [[] for _ in targets]
            top_logprobs = top.values.tolist() if top is not None else [[] for _ in targets]
            tokens += [SampledToken(*entry)
                       for entry in zip(targets, chosen.squeeze(1).tolist(), top_ids, top_logprobs, ranks)]
        return PromptLogprobs(first_position, tokens)

    def _compute_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """The final-norm hidden states of the step's rows: a replayed CUDA graph for a decode step that one
        fits, else the eager forward."""
        if self.decode_graphs is not None:
            hidden = self.decode_graphs.run(input_ids, positions, layout)
            if hidden is not None:
                return hidden
        meta = self.attention.build_metadata(layout, self.device)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _capture_decode_graphs(self) -> None:
        why = ("enforce_eager" if self.enforce_eager else f"device {self.device}" if self.device.type != "cuda"
               else f"the {self.attention_backend_name} attention backend" if self.attention_backend_name != "cupy"
               # A mixture of experts counts each expert's rows on the host, which a graph cannot replay.
               else "a mixture of experts" if self.config.moe else None)
        if why:
            logger.info("CUDA graphs off (%s): every step runs eagerly", why)
            return
        if not self.cuda_graph_batch_sizes:
            logger.info("CUDA graphs off: no batch size to capture")
            return
        from executor_svc.attention.cupy_backend import load_kernels

        started = time.perf_counter()
        load_kernels(self.device)  # compilation and module loading stay out of the capture
        graphs = cuda_graphs.DecodeGraphRunner(
            self.model, self.attention, self.kv_caches, device=self.device, block_size=self.block_size,
            hidden_size=self.config.hidden_size, batch_sizes=self.cuda_graph_batch_sizes,
            context_capacities=cuda_graphs.cuda_graph_context_capacities(self.max_model_len),
        )
        try:
            graphs.capture()
        except Exception:
            logger.exception("CUDA graph capture failed; every step runs eagerly")
            torch.cuda.synchronize(self.device)
            return
        self.decode_graphs = graphs
        logger.info(
            "captured %d CUDA graphs for decode in %.1f s: batch sizes %s, context capacities %s",
            len(graphs.graphs), time.perf_counter() - started, list(graphs.batch_sizes),
            list(graphs.context_capacities),
        )

    # ------------------------------------------------------------------ host memory: offload tier, swap space

    def _save_blocks(self, transfers: list[BlockTransfer]) -> None:
        if self.offload_tier is None or not transfers:
            return
        values = self._read_blocks([t.block_id for t in transfers])
        self.offload_tier.save([(t.block_hash, value) for t, value in zip(transfers, values)])
        self.blocks_saved += len(transfers)
        self.bytes_saved += sum(map(len, values))

    def _swap_out(self, transfers: list[BlockTransfer]) -> None:
        if self.swap_space is not None and transfers:
            values = self._read_blocks([t.block_id for t in transfers])
            self.swap_space.save([(t.block_hash, value) for t, value in zip(transfers, values)])

    def _load_blocks(self, requests: list[ExecuteRequest]) -> tuple[list[ExecuteRequest], int, int]:
        """Fills each request's blocks to load from host memory and drops their tokens from what it computes;
        a block found neither in the swap space nor in the tier (and every block after it) is computed."""
        out, num_loaded, num_failed = [], 0, 0
        for req in requests:
            if not req.load_blocks:
                out.append(req)
                continue
            values = self._find_blocks([t.block_hash for t in req.load_blocks])
            found = 0
            for value in values:
                if value is None or len(value) != self.block_bytes:
                    break
                found += 1
            if found:
                self._write_blocks([t.block_id for t in req.load_blocks[:found]], values[:found])
                self.bytes_loaded += found * self.block_bytes
            num_loaded += found
            num_failed += len(req.load_blocks) - found
            skip = num_loaded_tokens(req.load_blocks[:found], self.block_size)
            out.append(dataclasses.replace(
                req, token_ids=req.token_ids[skip:], start_position=req.start_position + skip, load_blocks=[]
            ))
        self.blocks_loaded += num_loaded
        self.failed_loads += num_failed
        return out, num_loaded, num_failed

    def _find_blocks(self, block_hashes: list[bytes]) -> list[bytes | None]:
        """Each block's bytes from the swap space, else from the offload tier; None where neither has it."""
        values = self.swap_space.load(block_hashes) if self.swap_space is not None else [None] * len(block_hashes)
        missing = [i for i, value in enumerate(values) if value is None]
        if missing and self.offload_tier is not None:
            for i, value in zip(missing, self.offload_tier.load([block_hashes[i] for i in missing])):
                values[i] = value
        return values

    def _read_blocks(self, block_ids: list[int]) -> list[bytes]:
        index = torch.as_tensor(block_ids, device=self.device)
        # [blocks, layers, 2, kv_heads, block_size, head_dim]: one block's K/V of every layer, contiguous.
        stacked = torch.stack([torch.stack((k[index], v[index]), dim=1) for k, v in self.kv_caches], dim=1)
        raw = stacked.cpu().contiguous().view(torch.uint8).numpy()
        return [raw[i].tobytes() for i in range(len(block_ids))]

    def _write_blocks(self, block_ids: list[int], values: list[bytes]) -> None:
        index = torch.as_tensor(block_ids, device=self.device)
        raw = torch.frombuffer(bytearray(b"".join(values)), dtype=torch.uint8)
        layers = len(self.kv_caches)
        stacked = raw.view(self.kv_dtype).view(len(block_ids), layers, 2, *self.kv_caches[0][0].shape[1:]).to(self.device)
        for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
            key_cache[index] = stacked[:, layer, 0]
            value_cache[index] = stacked[:, layer, 1]

    def _flatten(self, ordered: list[ExecuteRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = self.block_size
        positions = np.concatenate(
            [np.arange(r.start_position, r.start_position + len(r.token_ids)) for r in ordered]
        )
        block_of_token = np.concatenate([
            np.asarray(self.requests[r.request_id].block_ids, dtype=np.int64)[
                np.arange(r.start_position, r.start_position + len(r.token_ids)) // bs
            ]
            for r in ordered
        ])
        slots = block_of_token * bs + positions % bs
        input_ids = np.fromiter((t for r in ordered for t in r.token_ids), dtype=np.int64)
        as_tensor = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        return as_tensor(input_ids), as_tensor(positions), as_tensor(slots)
