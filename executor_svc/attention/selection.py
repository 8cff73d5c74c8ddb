"""Which attention backend a runner on a given device uses: the CuPy CUDA kernels, the C++ CPU kernels or the
torch reference."""
from __future__ import annotations

import torch

from executor_svc.attention.torch_backend import TorchPagedAttention

BACKEND_NAMES = ("auto", "torch", "cupy", "cpu")


def select_attention_backend(
    device: torch.device | str, name: str = "auto", *, head_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[type, str]:
    """(backend class, reason). "auto": the CuPy kernels on a CUDA device where cupy imports, the C++ CPU
    kernels on the CPU where they build, else torch.

    "torch", "cupy" and "cpu" force a backend; forcing one where it cannot run raises ValueError saying why.
    With head_dim given, "auto" also falls back to torch for head sizes the kernels do not implement.
    """
    from executor_svc.attention.cupy_backend import SUPPORTED_HEAD_DIMS, CupyPagedAttention, supported_reason

    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    device = torch.device(device)
    if name == "torch":
        return TorchPagedAttention, "torch backend requested"
    if device.type == "cpu" and name in ("auto", "cpu"):
        from executor_svc.attention.cpu_backend import CpuPagedAttention, unsupported_reason

        problem = unsupported_reason(head_dim or 16, dtype)
        if name == "cpu" and problem is not None:
            raise ValueError(f"the cpu attention backend cannot run here: {problem}")
        if problem is None:
            return CpuPagedAttention, f"cpu: C++ kernels, {CpuPagedAttention.isa()} path"
        return TorchPagedAttention, f"torch: {problem}"
    if name == "cpu":
        raise ValueError(f"the cpu attention backend cannot run on {device}")
    problem = supported_reason(device)
    if problem is None and head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        problem = f"head_dim {head_dim} is not one of the kernels' {SUPPORTED_HEAD_DIMS}"
    if name == "cupy":
        if problem is not None:
            raise ValueError(f"the cupy attention backend cannot run here: {problem}")
        return CupyPagedAttention, "cupy backend requested"
    if problem is not None:
        return TorchPagedAttention, f"torch: {problem}"
    return CupyPagedAttention, f"cupy: CUDA device {device} and cupy importable"
