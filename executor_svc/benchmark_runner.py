"""An executor that runs no model, for measuring the control plane alone (--benchmark-sleep-ms).

It answers Execute exactly as ModelRunner does (the same per-request state, validation, rejections, epoch
and scheduler checks, because it runs ModelRunner's step code) but its forward pass is the configured time on
a stand-in device, and the token it returns for a request at a position is a fixed function of both, never
an end-of-sequence token. The device runs steps as a GPU's queue does: one at a time, each from its launch
or the end of the step before it, whichever is later, while the host goes on to launch the next; a step's
result is handed over when its time on the device has passed. No weights are loaded and no KV tensors
allocated; the block count is what the same configuration would give a real executor, so the scheduler and
the block manager see the same pool.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
import uuid
import zlib

import torch

from executor_svc.kv_cache import kv_cache_budget, kv_cache_dtype, num_blocks_for_budget
from executor_svc.model_config import ModelArchitecture, parse_dtype
from executor_svc.model_loader import generation_eos_token_ids, model_fingerprint, resolve_model_dir
from executor_svc.model_runner import LaunchedStep, ModelRunner
from executor_svc.sampler import TokenCounts
from executor_svc.structured_output import StructuredOutput
from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedserve.step import ExecuteRequest, ExecuteResult, ExecuteStep, SampledToken

logger = logging.getLogger(__name__)


# prctl's option for a thread's timer slack: by default Linux lets a sleep run up to 50 us late, 1% of a 5 ms step
# that the busy fraction would count as control-plane time.
PR_SET_TIMERSLACK = 29
_slack_set = threading.local()


def sleep_exactly(seconds: float) -> None:
    """time.sleep with the calling thread's timer slack at its least (set on its first call; Linux only)."""
    if not getattr(_slack_set, "done", False):
        _slack_set.done = True
        try:
            ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the default slack stays
            pass
    time.sleep(seconds)


@functools.lru_cache(maxsize=1 << 14)
def _id_hash(request_id: str) -> int:
    """Stable across processes (unlike hash()); kept, since every step asks it of every running request."""
    return zlib.crc32(request_id.encode())


class SleepingStep(LaunchedStep):
    def result(self) -> ExecuteResult:
        if (delay := self.ready_at - time.monotonic()) > 0:
            sleep_exactly(delay)
        return self.outcome


class SleepingRunner(ModelRunner):
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None) -> None:
        from transformers import AutoConfig

        model_config = model_config.resolved()
        cache_config = cache_config or CacheConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        self.model_config, self.cache_config = model_config, cache_config
        self.sleep_s = model_config.benchmark_sleep_ms / 1000
        self.device_free_at = 0.0  # time.monotonic() at which the stand-in device finishes its last step
        self.device = torch.device("cpu")  # the pool is sized by the CPU rule: no device memory to measure
        self.dtype = parse_dtype(model_config.dtype)
        self.kv_dtype = kv_cache_dtype(cache_config.kv_cache_dtype, self.dtype)
        self.block_size = cache_config.block_size
        self.model_dir = resolve_model_dir(model_config.model)
        self.config = ModelArchitecture.from_hf_config(
            AutoConfig.from_pretrained(self.model_dir), model_config.max_model_len
        )
        self.eos_token_ids = tuple(
            sorted(set(self.config.eos_token_ids) | set(generation_eos_token_ids(self.model_dir)))
        )
        self.eos_token_set = frozenset(self.eos_token_ids)
        self.model_id = f"{model_fingerprint(self.model_dir)}|{model_config.dtype}|benchmark"
        self.attention_backend_name = "none"
        budget = kv_cache_budget(cache_config, self.device, self.config.kv_bytes_per_token(self.kv_dtype),
                                 self.config.max_model_len, scheduler_config.max_num_seqs)
        self.num_blocks = num_blocks_for_budget(self.config, self.kv_dtype, self.block_size, budget)
        self.max_model_len = min(self.config.max_model_len, self.num_blocks * self.block_size)
        self.block_bytes = self.config.kv_bytes_per_token(self.kv_dtype) * self.block_size
        self.requests = {}
        # The per-request state of penalties and grammars lives here too: the step code keeps it up to date.
        self.token_counts = TokenCounts(self.config.vocab_size, self.device)
        self.structured_output = StructuredOutput(self.model_dir, self.config.vocab_size, self.eos_token_ids)
        self.epoch = uuid.uuid4().hex
        self.scheduler_id = ""
        self.offload_tier = None  # no KV to save: blocks asked from the tier count as failed loads
        self.swap_space = None  # nor to swap: preemption recomputes
        self.prefill_tokens_per_s = self.copy_bytes_per_s = 0.0
        self.blocks_saved = self.blocks_loaded = self.failed_loads = 0
        self.bytes_saved = self.bytes_loaded = 0
        self.num_prefill_tokens = self.num_decode_tokens = 0
        logger.info("benchmarking executor: no model, %.1f ms per step, %d blocks x %d tokens",
                    model_config.benchmark_sleep_ms, self.num_blocks, self.block_size)

    def execute(self, step: ExecuteStep) -> ExecuteResult:
        return self.launch(step).result()

    def launch(self, step: ExecuteStep) -> SleepingStep:
        sampling, _, result = self._run_model(step)
        result.sampled = self._remember_samples(sampling, map(SampledToken, self.tokens_for(sampling)))
        if not result.num_prefill_tokens + result.num_decode_tokens:
            return SleepingStep(result)  # nothing ran: the device was not used
        self.device_free_at = max(time.monotonic(), self.device_free_at) + self.sleep_s
        return SleepingStep(result, self.device_free_at)

    def step_logits(self, step: ExecuteStep):
        raise NotImplementedError("the benchmarking executor computes no logits")

    def tokens_for(self, requests: list[ExecuteRequest]) -> list[int]:
        """The token sampled after each request's last position: fixed by the request id and that position.
        (Every running request asks every step, as a real executor's sampler answers for the whole batch.)"""
        vocab, eos = self.config.vocab_size, self.eos_token_set
        tokens = [(_id_hash(r.request_id) + r.start_position + len(r.token_ids)) % vocab for r in requests]
        if eos.isdisjoint(tokens):
            return tokens
        for i, token in enumerate(tokens):
            while token in eos:
                token = (token + 1) % vocab
            tokens[i] = token
        return tokens

    def _forward(self, requests: list[ExecuteRequest], num_loaded: int, num_failed: int):
        result = ExecuteResult(num_loaded_blocks=num_loaded, num_failed_loads=num_failed)
        if not requests:
            return [], None, result
        lengths = [len(r.token_ids) for r in requests]
        result.num_decode_tokens = lengths.count(1)
        result.num_prefill_tokens = sum(lengths) - result.num_decode_tokens
        self.num_prefill_tokens += result.num_prefill_tokens
        self.num_decode_tokens += result.num_decode_tokens
        return [r for r in requests if r.sample], None, result
