"""GPU tests: marked `gpu`, and skipped unless torch sees a CUDA device and cupy imports."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CuPy build that does not match the driver
        return f"cupy is not importable ({type(exc).__name__}: {exc})"
    return None


SKIP_REASON = _skip_reason()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if SKIP_REASON is not None:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
