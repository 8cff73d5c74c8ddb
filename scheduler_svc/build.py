"""The scheduler built from the configuration and the executor's facts: by `python -m scheduler_svc` and by
the offline LLM."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pagedserve.config import SchedulerConfig
from pagedserve.step import BlockStepRequest, BlockStepResult
from scheduler_svc.scheduler import Scheduler


def build_scheduler(config: SchedulerConfig, executor,
                    allocate_blocks: Callable[[BlockStepRequest], dict[str, BlockStepResult]],
                    one_executor: bool = True) -> Scheduler:
    """executor: what the executor reports (its ExecutorInfo): block size and context length. Without chunked
    prefill the token budget grows to the context length, so that any prompt fits in one step. one_executor:
    the plans are for that instance (else for those registered with the KV-cache service, each step's answer
    naming theirs)."""
    budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:
        budget = max(budget, executor.max_model_len)
    config = dataclasses.replace(config, block_size=executor.block_size, max_model_len=executor.max_model_len,
                                 max_num_batched_tokens=budget)
    return Scheduler(config, allocate_blocks, executor_epoch=executor.epoch if one_executor else "")
