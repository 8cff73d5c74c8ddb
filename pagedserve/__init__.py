"""pagedserve: an LLM inference server with paged KV cache and continuous batching, as gRPC services."""
from __future__ import annotations

from pagedserve.beam_search import BeamSearchParams
from pagedserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerationResult", "BeamSearchParams"]


def __getattr__(name: str):
    # The offline engine imports every service core; load it only when asked for, so that the
    # foundation (stubs, sampling parameters) imports no service.
    if name in ("LLM", "GenerationResult"):
        from pagedserve.entrypoints import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
