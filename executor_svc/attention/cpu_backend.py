"""Paged attention on the CPU with the C++ kernels of executor_svc/csrc: K/V are read through the block
tables in place (no gathered copy), and the step's K/V go into the cache through the same extension, which
also fuses the decoder's RMSNorm, rotary embedding (fused_cpu.cpp) and SiLU-and-mul (used by
executor_svc/models).

The extension is compiled by torch's cpp_extension on first use (g++ and ninja) and cached under torch's
extensions directory (TORCH_EXTENSIONS_DIR), keyed by the sources; later starts only load it. The kernels
pick AVX-512 (with AVX512-BF16's dot products for bfloat16 caches where the CPU has them), AVX2 + FMA or a
baseline path at run time from the CPU's flags.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from executor_svc.attention.layout import BatchLayout

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = (CSRC / "paged_attention_cpu.cpp", CSRC / "fused_cpu.cpp", CSRC / "linear_cpu.cpp")
DEPENDS = (CSRC / "paged_attention_impl.h",)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256
ISAS = ("avx512_bf16", "avx512", "avx2", "baseline")


@functools.cache
def load_extension():
    """The kernels' op namespace (torch.ops.pagedserve_cpu), compiling them on first use."""
    from torch.utils.cpp_extension import _get_build_directory, load

    # The build is named by the sources' contents (the header's too, which ninja does not track here) and their
    # directory: another checkout, or other sources, build beside it rather than over it, one rebuilding the
    # other's build at every start.
    digest = hashlib.sha256(str(CSRC).encode() + b"".join(p.read_bytes() for p in SOURCES + DEPENDS)).hexdigest()[:12]
    name = f"pagedserve_cpu_attention_{digest}"
    build_dir = Path(_get_build_directory(name, verbose=False))
    # torch marks a build in progress with a `lock` file that only the builder removes: one killed while building
    # (kill -9, the OOM killer, a container stopped) leaves it, and every later load waits for it forever. Builds
    # and loads here hold a lock the kernel releases when its holder dies instead; under it, a `lock` file is
    # necessarily such a leftover.
    with open(build_dir / "pagedserve.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (build_dir / "lock").exists():
            logger.warning("removing %s, left by a build of the CPU kernels that did not finish", build_dir / "lock")
            (build_dir / "lock").unlink(missing_ok=True)
        if not (build_dir / f"{name}.so").is_file():
            # Said before the wait, so that a first start is not taken for a hung one.
            logger.info("compiling the CPU kernels (executor_svc/csrc) with g++: once for these sources, about a "
                        "minute")
        load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=["-O3", "-fopenmp"],
             extra_ldflags=["-fopenmp"], is_python_module=False)
    return torch.ops.pagedserve_cpu


def unsupported_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot serve this model, or None."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not one of the kernels' {SUPPORTED_DTYPES}"
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of 16 up to {MAX_HEAD_DIM}"
    try:
        load_extension()
    except Exception as error:  # no compiler, no ninja: the caller falls back to the torch backend
        return f"the CPU kernels did not build: {type(error).__name__}: {error}"
    return None


def supported_isas() -> list[str]:
    """The instruction-set paths this CPU can run, widest first."""
    ops = load_extension()
    found = []
    active = ops.active_isa()
    for isa in ISAS:
        try:
            ops.select_isa(isa)
        except RuntimeError:
            continue
        found.append(isa)
    ops.select_isa(active)
    return found


@dataclass(slots=True)
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start: torch.Tensor  # [num_seqs + 1] int32: sequence i owns rows [query_start[i], query_start[i + 1])
    context_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, rows padded with block 0


class CpuPagedAttention:
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.ops = load_extension()
        # Metadata buffers kept across steps and grown when a step needs more: a step fills them in place.
        self._query_start = np.zeros(1, dtype=np.int32)
        self._context_lens = np.zeros(0, dtype=np.int32)
        self._tables = np.zeros((0, 0), dtype=np.int32)

    @staticmethod
    def isa() -> str:
        """The instruction-set path the kernels run: avx512_bf16, avx512, avx2 or baseline."""
        return load_extension().active_isa()

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> CpuAttentionMetadata:
        num_seqs = len(layout.query_lens)
        max_blocks = -(-max(layout.context_lens, default=0) // layout.block_size)
        if num_seqs + 1 > len(self._query_start):
            self._query_start = np.zeros(2 * num_seqs + 1, dtype=np.int32)
            self._context_lens = np.zeros(2 * num_seqs, dtype=np.int32)
        if num_seqs > self._tables.shape[0] or max_blocks > self._tables.shape[1]:
            self._tables = np.zeros((max(num_seqs, self._tables.shape[0]), max(max_blocks, self._tables.shape[1])),
                                    dtype=np.int32)
        np.cumsum(layout.query_lens, out=self._query_start[1 : num_seqs + 1])
        self._context_lens[:num_seqs] = layout.context_lens
        tables = self._tables[:num_seqs, :max_blocks]
        for row, table in enumerate(layout.block_tables):
            held = table[:max_blocks]
            tables[row, : len(held)] = held
        return CpuAttentionMetadata(
            layout.slot_mapping,
            torch.from_numpy(self._query_start[: num_seqs + 1]),
            torch.from_numpy(self._context_lens[:num_seqs]),
            torch.from_numpy(self._tables[:num_seqs]),
        )

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads * head_dim]
        key: torch.Tensor,  # [T, num_kv_heads * head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,
        meta: CpuAttentionMetadata,
        window: int | None = None,  # a sliding window: a query at position p sees the keys at (p - window, p]
        softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) before the mask
    ) -> torch.Tensor:
        self.ops.write_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        self.ops.paged_attention(out, query, key_cache, value_cache, meta.query_start, meta.context_lens,
                                 meta.block_tables, self.num_heads, self.scale, window or 0, softcap or 0.0)
        return out
