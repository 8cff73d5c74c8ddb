"""Runs one engine step: flat batch in, one sampled token per finishing chunk out.

The runner keeps per-request state between steps (block table, sampling parameters), so a steady-state
decode step carries a few integers per request. It owns the model, the KV tensors and the sampler.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention.layout import BatchLayout
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.kv_cache import allocate_kv_caches, available_memory, num_blocks_for_budget
from executor_svc.model_config import ModelConfig, parse_dtype
from executor_svc.model_loader import generation_eos_token_ids, iterate_weights, resolve_model_dir
from executor_svc.models.llama import LlamaForCausalLM
from executor_svc.sampler import Sampler, SamplingBatch
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteRequest, ExecuteResult, ExecuteStep

logger = logging.getLogger(__name__)

@dataclass
class RequestState:
    params: SamplingParams
    block_ids: list[int]
    prompt_len: int


class ModelRunner:
    def __init__(
        self,
        model: str = "default",
        *,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        kv_cache_fraction: float = 0.3,
        max_model_len: int | None = None,
    ) -> None:
        from transformers import AutoConfig

        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 < kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction}")
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.block_size = block_size
        self.model_dir = resolve_model_dir(model)
        self.config = ModelConfig.from_hf_config(AutoConfig.from_pretrained(self.model_dir), max_model_len)
        self.eos_token_ids = tuple(
            sorted(set(self.config.eos_token_ids) | set(generation_eos_token_ids(self.model_dir)))
        )

        self.attention = TorchPagedAttention(
            self.config.num_heads, self.config.num_kv_heads, self.config.head_dim, self.config.head_dim**-0.5
        )
        with torch.device(self.device):
            self.model = LlamaForCausalLM(self.config, self.attention)
        self.model.load_weights(iterate_weights(self.model_dir))
        self.model.to(self.dtype).eval()
        self.model.rotary.float()  # RoPE tables stay float32, as transformers keeps them

        budget = kv_cache_memory if kv_cache_memory is not None else int(
            available_memory(self.device) * kv_cache_fraction
        )
        self.num_blocks = num_blocks_for_budget(self.config, self.dtype, block_size, budget)
        self.kv_caches = allocate_kv_caches(self.config, self.num_blocks, block_size, self.dtype, self.device)
        # A request alone must always fit in the pool, or preemption could never make room for it.
        self.max_model_len = min(self.config.max_model_len, self.num_blocks * block_size)
        if self.max_model_len < self.config.max_model_len:
            logger.warning("KV cache holds %d tokens; capping the context length at that", self.max_model_len)
        logger.info(
            "model %s (%s, %s) on %s; KV cache %d blocks x %d tokens (%.1f MiB)",
            self.model_dir, self.config.model_type, dtype, self.device, self.num_blocks, block_size,
            budget / 2**20,
        )
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        # Tokens whose K/V this runner has computed since start (prefix-cache hits are not among them).
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    @torch.inference_mode()
    def execute(self, step: ExecuteStep) -> ExecuteResult:
        sampling, logits, result = self._run_model(step)
        if not sampling:
            return result
        params = [self.requests[r.request_id].params for r in sampling]
        sampled_positions = [r.start_position + len(r.token_ids) for r in sampling]
        self._ban_stop_tokens_before_min_tokens(logits, sampling, sampled_positions)
        batch = SamplingBatch.build(params, self.device)
        tokens = self.sampler(logits, batch, sampled_positions).to_sampled_tokens(batch)
        result.sampled = {req.request_id: token for req, token in zip(sampling, tokens)}
        return result

    def _ban_stop_tokens_before_min_tokens(self, logits, sampling, sampled_positions) -> None:
        for row, (req, position) in enumerate(zip(sampling, sampled_positions)):
            state = self.requests[req.request_id]
            if position - state.prompt_len >= state.params.min_tokens:
                continue
            banned = list(state.params.stop_token_ids)
            if not state.params.ignore_eos:
                banned.extend(self.eos_token_ids)
            logits[row, banned] = float("-inf")

    @torch.inference_mode()
    def step_logits(self, step: ExecuteStep) -> dict[str, torch.Tensor]:
        """Runs the step like execute() but returns the float32 logits of each sampling request."""
        sampling, logits, _ = self._run_model(step)
        return {req.request_id: logits[row] for row, req in enumerate(sampling)}

    def _run_model(self, step: ExecuteStep) -> tuple[list[ExecuteRequest], torch.Tensor | None, ExecuteResult]:
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for req in step.requests:
            if req.sampling_params is not None:
                self.requests[req.request_id] = RequestState(
                    req.sampling_params, list(req.new_block_ids), req.prompt_len
                )
            elif req.request_id in self.requests:
                self.requests[req.request_id].block_ids.extend(req.new_block_ids)
            else:
                raise KeyError(f"request {req.request_id!r} is unknown to the executor and carries no sampling_params")
        if not step.requests:
            return [], None, ExecuteResult()

        # Prefill chunks first, then single-token rows sorted by context length for grouping.
        prefills = [r for r in step.requests if len(r.token_ids) > 1]
        singles = sorted((r for r in step.requests if len(r.token_ids) == 1), key=lambda r: r.start_position)
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
        meta = self.attention.build_metadata(layout, self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        result = ExecuteResult(
            num_prefill_tokens=layout.num_prefill_tokens,
            num_decode_tokens=input_ids.shape[0] - layout.num_prefill_tokens,
        )
        self.num_prefill_tokens += result.num_prefill_tokens
        self.num_decode_tokens += result.num_decode_tokens
        row_ends = np.cumsum([len(r.token_ids) for r in ordered]) - 1
        sample_rows = [int(row_ends[i]) for i, r in enumerate(ordered) if r.sample]
        if not sample_rows:
            return [], None, result
        logits = self.model.compute_logits(hidden[torch.as_tensor(sample_rows, device=self.device)])
        return [r for r in ordered if r.sample], logits, result

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
