"""GPU tests: marked `gpu`, and skipped unless torch sees a CUDA device and cupy imports.

Under tools/gpu_check.sh a step's time cap must not cost its JUnit XML: tests not started by
PAGEDSERVE_TEST_DEADLINE (epoch seconds, set a little before the cap) are skipped, and the cap's SIGTERM
ends the session like Ctrl-C, which still writes the report of the tests that ran.
"""
from __future__ import annotations

import os
import signal
import time
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
DEADLINE = float(os.environ.get("PAGEDSERVE_TEST_DEADLINE", "inf"))


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}: the time cap of this step")


signal.signal(signal.SIGTERM, _interrupt)


def pytest_runtest_setup(item):
    if time.time() > DEADLINE:
        pytest.skip("not started: the gpu-check step's time cap is near")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if SKIP_REASON is not None:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
