"""Output processing, shared by the frontend and the offline LLM: incremental detokenization
(``detokenizer``), stop strings (``stop_strings``), and the per-request state that applies both and
reports finish reasons and usage (``processor``)."""
from __future__ import annotations

from pagedserve.output.processor import OutputDelta, RequestOutputState, Usage

__all__ = ["OutputDelta", "RequestOutputState", "Usage"]
