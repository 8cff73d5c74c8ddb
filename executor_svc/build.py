"""The executor's core built from the configuration: by `python -m executor_svc` and by the offline LLM."""
from __future__ import annotations

from executor_svc.model_runner import ModelRunner
from executor_svc.offload import make_tier
from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig


def build_model_runner(model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig) -> ModelRunner:
    if model.benchmark_sleep_ms is not None:
        from executor_svc.benchmark_runner import SleepingRunner

        return SleepingRunner(model, cache, scheduler)
    tier = make_tier(cache.offload_kind, host_bytes=cache.offload_host_bytes, redis_url=cache.redis_url,
                     redis_ttl=cache.redis_ttl, redis_namespace=cache.redis_namespace)
    return ModelRunner(model, cache, scheduler, offload_tier=tier)
