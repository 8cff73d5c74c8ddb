"""Paged attention on CUDA through CuPy RawModule kernels (executor_svc/kernels/*.cu).

Same interface as TorchPagedAttention: ``build_metadata(layout, device)`` once per step, then
``forward(query, key, value, key_cache, value_cache, meta)`` per layer. A forward is

1. ``cache_write``: the step's K/V rows into their slots of the HND cache;
2. for bfloat16 / float16: ``paged_prefill`` over the prefill chunks (tensor cores, causal, GQA-packed) and
   ``paged_decode`` over the single-token rows (GQA-aware; split-K over the context when that fills the
   GPU's resident CTA slots better, the last partition of each row merging them in the same launch);
3. for float32 (tests, reference runs): ``paged_attention_rows`` over every row, on CUDA cores.

The work is split in two so that most of it runs without a GPU: ``plan_batch`` (numpy) turns a layout into
the int32 arrays the kernels read and ``plan_forward`` turns tensors and metadata into a list of
``Launch`` records (kernel name, grid, block, shared memory, arguments). ``forward`` hands the list to a
launcher: CuPy on torch's current stream by default; the CPU tests pass an emulator instead.

Decode is CUDA-graph capturable: given metadata built beforehand, ``forward`` for a decode-only batch does
no host synchronisation and no device allocation besides its output tensor (torch's caching allocator,
which graph capture supports); all kernel arguments are device pointers and Python scalars.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from executor_svc.attention.layout import BatchLayout

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
KERNEL_FILES = ("cache_write.cu", "paged_decode.cu", "paged_prefill.cu")
COMPILE_OPTIONS = ("-std=c++17",)

SUPPORTED_HEAD_DIMS = (64, 128)
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)

# Mirrors of the kernels' compile-time constants (see the .cu files).
SMEM_PAD = 8  # elements of padding per shared-memory row
CACHE_WRITE_THREADS = 128
DECODE_THREADS, DECODE_TILE, DECODE_ROWS = 128, 64, 16
PREFILL_THREADS, PREFILL_TILE, PREFILL_ROWS = 128, 64, 64
ROWS_THREADS = 32
STATIC_SMEM_LIMIT = 48 * 1024  # more dynamic shared memory than this needs the kernel attribute raised

# Split-K for decode: contexts are never cut into slices shorter than MIN_PARTITION keys (below that the
# partial results cost more than the parallelism gains). A partition's fixed cost (query load, pipeline
# fill, epilogue) is about PARTITION_OVERHEAD_TILES tiles of streaming.
MIN_PARTITION = 256
PARTITION_OVERHEAD_TILES = 1


@dataclass(frozen=True, slots=True)
class SmLimits:
    """What bounds the CTAs resident on one multiprocessor; the defaults are an H100 / H200 (sm_90), used
    when metadata is built for a non-CUDA device."""

    num_sms: int = 132
    registers: int = 65536
    shared_memory: int = 228 * 1024
    threads: int = 2048
    ctas: int = 32


SM90 = SmLimits()
SMEM_RESERVED_PER_CTA = 1024  # the driver's own shared memory per resident CTA (sm_80 and later)
# paged_decode registers per thread at sm_90 (kernels-check prints them); on a GPU the loaded kernel's own
# count is used instead.
SM90_DECODE_REGISTERS = {64: 94, 128: 164}

LOG2_E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the kernels' window argument without a sliding window: wider than any context


def decode_smem_bytes(head_dim: int) -> int:
    """sQ [16][D + 8] and two stages of sK, sV [64][D + 8], 16-bit elements."""
    return (DECODE_ROWS + 2 * 2 * DECODE_TILE) * (head_dim + SMEM_PAD) * 2


def prefill_smem_bytes(head_dim: int) -> int:
    """sQ [64][D + 8] and two stages of sK, sV [64][D + 8], 16-bit elements."""
    return (PREFILL_ROWS + 2 * 2 * PREFILL_TILE) * (head_dim + SMEM_PAD) * 2


def kernel_source() -> str:
    """The one translation unit handed to NVRTC: common.cuh, then every kernel file, includes inlined."""
    common = (KERNEL_DIR / "common.cuh").read_text().replace("#pragma once\n", "")
    parts = [common]
    for name in KERNEL_FILES:
        text = (KERNEL_DIR / name).read_text().replace('#include "common.cuh"\n', "")
        parts.append(f"// ===== {name} =====\n{text}")
    return "\n".join(parts)


def kernel_names(source: str | None = None) -> list[str]:
    """Every extern "C" kernel, read off the instantiation macros (PS_DECODE(paged_decode_bf16_d64, ...))."""
    return re.findall(r"^PS_[A-Z_]+\((\w+),", source if source is not None else kernel_source(), re.M)


@dataclass(frozen=True, slots=True)
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int  # dynamic shared memory, bytes
    args: tuple  # device pointers as int, scalars as np.int32 / np.int64 / np.float32


@dataclass(slots=True)
class HostPlan:
    """The int32 arrays one step's kernels read, built on the host from a BatchLayout."""

    num_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    max_context_len: int
    block_tables: np.ndarray  # [num_seqs, table_stride]: prefill sequences first, then decode rows
    prefill_seqs: np.ndarray  # [num_prefills, 3]: first query row, query count, context length
    prefill_work: np.ndarray  # [num_work, 2]: prefill sequence, first packed (query, head) row; longest first
    decode_context_lens: np.ndarray  # [num_decodes]
    row_seq: np.ndarray  # [num_tokens]: sequence (table row) of each query row
    row_keys: np.ndarray  # [num_tokens]: keys each query row sees (its position + 1)
    decode_partitions: int
    decode_partition_size: int


@dataclass(slots=True)
class CupyAttentionMetadata:
    num_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    block_size: int
    max_context_len: int
    slot_mapping: torch.Tensor  # [num_tokens] int32
    block_tables: torch.Tensor  # [num_seqs, table_stride] int32, prefill sequences first
    prefill_seqs: torch.Tensor  # [num_prefills, 3] int32
    prefill_work: torch.Tensor  # [num_work, 2] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    row_seq: torch.Tensor  # [num_tokens] int32 (float32 path)
    row_keys: torch.Tensor  # [num_tokens] int32 (float32 path)
    decode_partitions: int
    decode_partition_size: int
    decode_part_out: torch.Tensor | None  # [num_decodes, num_heads, partitions, head_dim] float32 (split-K)
    decode_part_ml: torch.Tensor | None  # [num_decodes, num_heads, partitions, 2] float32: (max, denominator)
    decode_counters: torch.Tensor | None  # [num_decodes, decode CTAs per row] int32, zero between launches

    @property
    def table_stride(self) -> int:
        return self.block_tables.shape[1]

    @property
    def num_prefill_work(self) -> int:
        return self.prefill_work.shape[0]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def resident_ctas(threads: int, registers_per_thread: int, smem: int, limits: SmLimits) -> int:
    """CTAs of a kernel that fit on one multiprocessor at once (the CUDA occupancy calculation: registers
    are allocated per warp in units of 256, shared memory per CTA plus the driver's reserve)."""
    warps = -(-threads // 32)
    by_registers = limits.registers // (warps * _round_up(registers_per_thread * 32, 256))
    by_smem = limits.shared_memory // (smem + SMEM_RESERVED_PER_CTA)
    return max(1, min(by_registers, by_smem, limits.threads // threads, limits.ctas))


def plan_decode_partitions(num_decodes: int, ctas_per_row: int, max_context_len: int, slots: int) -> tuple[int, int]:
    """(partitions, partition size in keys) for the decode rows, given `slots` CTAs resident on the GPU.

    Memory-bound CTAs that start together finish together, so a launch takes about (waves of `slots`
    CTAs) x (tiles per partition + a partition's fixed cost), plus the merge, which reads each partition's
    partial result (a quarter of a tile's bytes per partition). The plan minimises that over partition
    sizes (multiples of the 64-key tile, at least MIN_PARTITION keys), fewer partitions on ties: one
    partition when the rows alone fill the slots in whole waves, more when the rows leave slots idle.
    """
    tiles = max(1, -(-max_context_len // DECODE_TILE))
    if num_decodes == 0:
        return 1, tiles * DECODE_TILE
    ctas_per_partition = num_decodes * ctas_per_row
    best = None
    for size in range(tiles, min(tiles, MIN_PARTITION // DECODE_TILE) - 1, -1):
        partitions = -(-tiles // size)
        waves = -(-ctas_per_partition * partitions // slots)
        cost = waves * (size + PARTITION_OVERHEAD_TILES) + (partitions / 4 if partitions > 1 else 0)
        if best is None or cost < best[0] or (cost == best[0] and partitions < best[1]):
            best = (cost, partitions, size)
    _, partitions, size = best
    return partitions, (size if partitions > 1 else tiles) * DECODE_TILE


def plan_batch(
    layout: BatchLayout, num_heads: int, num_kv_heads: int, resident_decode_ctas: int | None = None, *,
    context_capacity: int = 0,
) -> HostPlan:
    """Validates a layout and builds the kernels' index arrays (numpy, no device needed).

    resident_decode_ctas: decode CTAs resident on the whole GPU at once (default: an H100 / H200, head_dim 64).

    context_capacity: the longest context the arrays must be able to serve later (CUDA-graph replay with
    refilled metadata): the table width and the decode partition plan cover at least that many keys.
    """
    query_lens, context_lens, tables = layout.query_lens, layout.context_lens, layout.block_tables
    num_seqs, num_prefills, block_size = len(query_lens), layout.num_prefills, layout.block_size
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if len(context_lens) != num_seqs or len(tables) != num_seqs:
        raise ValueError(
            f"layout lists disagree: {num_seqs} query_lens, {len(context_lens)} context_lens, {len(tables)} block_tables"
        )
    if not 0 <= num_prefills <= num_seqs:
        raise ValueError(f"num_prefills {num_prefills} is outside [0, {num_seqs}]")
    blocks_needed = []
    for i, (n, ctx, table) in enumerate(zip(query_lens, context_lens, tables)):
        if n < 1 or ctx < n:
            raise ValueError(f"sequence {i}: query_len {n} and context_len {ctx} need 1 <= query_len <= context_len")
        if i >= num_prefills and n != 1:
            raise ValueError(f"sequence {i} comes after the {num_prefills} prefill chunks but has {n} query tokens")
        needed = -(-ctx // block_size)
        if len(table) < needed:
            raise ValueError(f"sequence {i}: context_len {ctx} needs {needed} blocks, its table has {len(table)}")
        blocks_needed.append(needed)
    num_tokens = int(sum(query_lens))
    if tuple(layout.slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping has shape {tuple(layout.slot_mapping.shape)}, the batch has {num_tokens} tokens")

    stride = max(max(blocks_needed, default=1), -(-context_capacity // block_size))
    block_tables = np.zeros((num_seqs, stride), dtype=np.int32)
    for i, table in enumerate(tables):
        block_tables[i, : blocks_needed[i]] = table[: blocks_needed[i]]

    group = num_heads // num_kv_heads
    prefill_seqs = np.zeros((num_prefills, 3), dtype=np.int32)
    work, row = [], 0
    for i in range(num_prefills):
        n, ctx = query_lens[i], context_lens[i]
        prefill_seqs[i] = (row, n, ctx)
        packed_rows = n * group
        for m0 in range(0, packed_rows, PREFILL_ROWS):
            last_query = (min(m0 + PREFILL_ROWS, packed_rows) - 1) // group
            work.append((ctx - n + last_query + 1, i, m0))  # keys the tile sweeps, for ordering
        row += n
    work.sort(key=lambda w: -w[0])  # longest first: the long tiles start early, short ones fill the tail
    prefill_work = np.array([(i, m0) for _, i, m0 in work], dtype=np.int32).reshape(-1, 2)

    decode_context_lens = np.asarray(context_lens[num_prefills:], dtype=np.int32)
    row_seq = np.empty(num_tokens, dtype=np.int32)
    row_keys = np.empty(num_tokens, dtype=np.int32)
    row = 0
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        row_seq[row : row + n] = i
        row_keys[row : row + n] = np.arange(ctx - n + 1, ctx + 1)
        row += n

    max_context_len = int(max(context_lens, default=0))
    head_groups = -(-group // DECODE_ROWS)
    max_decode_context = int(decode_context_lens.max()) if decode_context_lens.size else 0
    if decode_context_lens.size:
        max_decode_context = max(max_decode_context, context_capacity)
    if resident_decode_ctas is None:
        resident_decode_ctas = default_decode_slots(64)
    partitions, partition_size = plan_decode_partitions(
        len(decode_context_lens), num_kv_heads * head_groups, max_decode_context, resident_decode_ctas
    )
    return HostPlan(
        num_tokens=num_tokens,
        num_prefills=num_prefills,
        num_prefill_tokens=int(sum(query_lens[:num_prefills])),
        num_decodes=len(decode_context_lens),
        max_context_len=max_context_len,
        block_tables=block_tables,
        prefill_seqs=prefill_seqs,
        prefill_work=prefill_work,
        decode_context_lens=decode_context_lens,
        row_seq=row_seq,
        row_keys=row_keys,
        decode_partitions=partitions,
        decode_partition_size=partition_size,
    )


def default_decode_slots(head_dim: int) -> int:
    """Resident decode CTAs on an H100 / H200, from the sm_90 register count of the kernel."""
    regs = SM90_DECODE_REGISTERS[head_dim]
    return SM90.num_sms * resident_ctas(DECODE_THREADS, regs, decode_smem_bytes(head_dim), SM90)


_DECODE_SLOTS: dict[tuple[int, int], int] = {}


def decode_slots(device: torch.device, head_dim: int) -> int:
    """Resident decode CTAs on `device`: its multiprocessors' limits and the loaded kernel's registers."""
    if device.type != "cuda":
        return default_decode_slots(head_dim)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, head_dim)
    if key not in _DECODE_SLOTS:
        props = torch.cuda.get_device_properties(index)
        limits = SmLimits(num_sms=props.multi_processor_count, registers=props.regs_per_multiprocessor,
                          shared_memory=props.shared_memory_per_multiprocessor,
                          threads=props.max_threads_per_multi_processor)
        smem = decode_smem_bytes(head_dim)
        import cupy

        with cupy.cuda.Device(index):
            registers = _kernel(f"paged_decode_bf16_d{head_dim}", index, smem).num_regs
        _DECODE_SLOTS[key] = limits.num_sms * resident_ctas(DECODE_THREADS, registers, smem, limits)
    return _DECODE_SLOTS[key]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class CupyPagedAttention:
    """Paged attention through the CUDA kernels of executor_svc/kernels, launched with CuPy."""

    name = "cupy"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        launcher: Callable[[Sequence[Launch], torch.device], None] | None = None,
    ) -> None:
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported by the CUDA kernels; supported: {SUPPORTED_HEAD_DIMS}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.launcher = launcher if launcher is not None else launch_with_cupy

    @property
    def decode_ctas_per_row(self) -> int:
        """Decode CTAs per row and partition: one per KV head and group of up to 16 of its query heads."""
        return self.num_kv_heads * -(-self.group // DECODE_ROWS)

    # ---- metadata -------------------------------------------------------------------------------------
    def build_metadata(
        self, layout: BatchLayout, device: torch.device, *, context_capacity: int = 0
    ) -> CupyAttentionMetadata:
        """Device metadata for one step. With context_capacity, the metadata of a decode-only batch can
        later be refilled in place (refill_metadata) with any batch of as many rows whose contexts stay
        within that many keys: what a captured CUDA graph replays with."""
        device = torch.device(device)
        plan = plan_batch(layout, self.num_heads, self.num_kv_heads, decode_slots(device, self.head_dim),
                          context_capacity=context_capacity)
        return self.metadata_from_plan(plan, layout.slot_mapping, layout.block_size, device)

    def refill_metadata(self, meta: CupyAttentionMetadata, layout: BatchLayout) -> None:
        """Writes a decode-only layout into `meta`'s tensors in place, keeping every tensor and scalar a
        captured forward baked in (row count, table width, partitions); raises ValueError if it does not fit."""
        _check(layout.num_prefills == 0 and meta.num_prefills == 0, "refill_metadata serves decode-only batches")
        _check(layout.block_size == meta.block_size, f"block size {layout.block_size}, metadata {meta.block_size}")
        plan = plan_batch(layout, self.num_heads, self.num_kv_heads, default_decode_slots(self.head_dim))
        _check(plan.num_decodes == meta.num_decodes, f"{plan.num_decodes} rows, the metadata holds {meta.num_decodes}")
        width = plan.block_tables.shape[1]
        capacity = meta.decode_partitions * meta.decode_partition_size
        _check(width <= meta.table_stride and int(plan.decode_context_lens.max()) <= capacity,
               f"contexts up to {int(plan.decode_context_lens.max())} keys exceed the metadata's capacity "
               f"({capacity} keys, {meta.table_stride} blocks per table)")
        tables = np.zeros(tuple(meta.block_tables.shape), dtype=np.int32)
        tables[:, :width] = plan.block_tables
        host = np.concatenate([tables.reshape(-1), plan.decode_context_lens, plan.row_seq, plan.row_keys])
        host = torch.from_numpy(host)
        n = meta.num_decodes
        meta.block_tables.view(-1).copy_(host[: tables.size])
        meta.decode_context_lens.copy_(host[tables.size : tables.size + n])
        meta.row_seq.copy_(host[tables.size + n : tables.size + 2 * n])
        meta.row_keys.copy_(host[tables.size + 2 * n :])
        meta.slot_mapping.copy_(layout.slot_mapping.to(dtype=torch.int32))
        meta.max_context_len = plan.max_context_len

    def metadata_from_plan(
        self, plan: HostPlan, slot_mapping: torch.Tensor, block_size: int, device: torch.device
    ) -> CupyAttentionMetadata:
        # All int32 arrays travel in one host-to-device copy and are sliced there.
        arrays = [plan.block_tables, plan.prefill_seqs, plan.prefill_work, plan.decode_context_lens,
                  plan.row_seq, plan.row_keys]
        flat = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int32, copy=False)
        packed = torch.from_numpy(flat).to(device)
        views, offset = [], 0
        for a in arrays:
            views.append(packed[offset : offset + a.size].view(a.shape))
            offset += a.size
        block_tables, prefill_seqs, prefill_work, decode_context_lens, row_seq, row_keys = views

        part_out = part_ml = counters = None
        if plan.decode_partitions > 1:
            shape = (plan.num_decodes, self.num_heads, plan.decode_partitions)
            part_out = torch.empty(shape + (self.head_dim,), dtype=torch.float32, device=device)
            part_ml = torch.empty(shape + (2,), dtype=torch.float32, device=device)
            # Zeroed once: the CTA that merges a row resets its counter, graph replays included.
            counters = torch.zeros((plan.num_decodes, self.decode_ctas_per_row), dtype=torch.int32, device=device)
        return CupyAttentionMetadata(
            num_tokens=plan.num_tokens,
            num_prefills=plan.num_prefills,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decodes=plan.num_decodes,
            block_size=block_size,
            max_context_len=plan.max_context_len,
            slot_mapping=slot_mapping.to(device=device, dtype=torch.int32),
            block_tables=block_tables,
            prefill_seqs=prefill_seqs,
            prefill_work=prefill_work,
            decode_context_lens=decode_context_lens,
            row_seq=row_seq,
            row_keys=row_keys,
            decode_partitions=plan.decode_partitions,
            decode_partition_size=plan.decode_partition_size,
            decode_part_out=part_out,
            decode_part_ml=part_ml,
            decode_counters=counters,
        )

    # ---- forward --------------------------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads * head_dim]
        key: torch.Tensor,  # [T, num_kv_heads * head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,
        meta: CupyAttentionMetadata,
        window: int | None = None,  # a sliding window: a query at position p sees the keys at (p - window, p]
        softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) before the mask
    ) -> torch.Tensor:
        out = torch.empty((query.shape[0], self.num_heads * self.head_dim), dtype=query.dtype, device=query.device)
        launches = self.plan_forward(query, key, value, key_cache, value_cache, meta, out, window, softcap)
        if launches:
            self.launcher(launches, query.device)
        return out

    def plan_forward(self, query, key, value, key_cache, value_cache, meta: CupyAttentionMetadata, out,
                     window: int | None = None, softcap: float | None = None) -> list[Launch]:
        """The kernel launches of one forward, after checking every tensor they touch."""
        self._check_inputs(query, key, value, key_cache, value_cache, meta, out)
        _check(window is None or window >= 1, f"window must be at least 1, got {window}")
        _check(softcap is None or softcap > 0, f"softcap must be positive, got {softcap}")
        num_tokens = query.shape[0]
        if num_tokens == 0:
            return []
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        dtype = query.dtype
        suffix = DTYPE_SUFFIX[dtype]
        i32, i64, f32 = np.int32, np.int64, np.float32
        block_size_log2 = i32(meta.block_size.bit_length() - 1)
        scale_log2 = f32(self.scale * LOG2_E)
        window_arg = i32(NO_WINDOW if window is None else min(window, NO_WINDOW))
        # The kernels' scores are in log2 units: c * tanh(s / c) there is c' * tanh(s' / c') with c' = c * log2(e).
        softcap_log2 = f32(0.0 if softcap is None else softcap * LOG2_E)
        q_stride = i64(query.stride(0))
        stride = meta.table_stride
        launches = []

        vec = 16 // query.element_size()
        total = num_tokens * kvh * (d // vec)
        launches.append(Launch(
            f"cache_write_{suffix}", (-(-total // CACHE_WRITE_THREADS), 1, 1), (CACHE_WRITE_THREADS, 1, 1), 0,
            (key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
             meta.slot_mapping.data_ptr(), i32(num_tokens), i32(kvh), i32(d), i32(meta.block_size),
             i64(key.stride(0)), i64(value.stride(0))),
        ))

        if dtype not in TENSOR_CORE_DTYPES:
            launches.append(Launch(
                f"paged_attention_rows_{suffix}_d{d}", (num_tokens, h, 1), (ROWS_THREADS, 1, 1), 0,
                (out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                 meta.block_tables.data_ptr(), meta.row_seq.data_ptr(), meta.row_keys.data_ptr(),
                 i32(h), i32(kvh), block_size_log2, i32(stride), q_stride, scale_log2, window_arg, softcap_log2),
            ))
            return launches

        if meta.num_prefill_work:
            launches.append(Launch(
                f"paged_prefill_{suffix}_d{d}", (meta.num_prefill_work, kvh, 1), (PREFILL_THREADS, 1, 1),
                prefill_smem_bytes(d),
                (out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                 meta.block_tables.data_ptr(), meta.prefill_seqs.data_ptr(), meta.prefill_work.data_ptr(),
                 i32(h), i32(kvh), block_size_log2, i32(stride), q_stride, scale_log2, window_arg, softcap_log2),
            ))
        if meta.num_decodes:
            parts = meta.decode_partitions
            split = parts > 1
            # The decode rows' table rows follow the prefill sequences' rows.
            tables = meta.block_tables.data_ptr() + meta.num_prefills * stride * 4
            workspace = ((meta.decode_part_out.data_ptr(), meta.decode_part_ml.data_ptr(),
                          meta.decode_counters.data_ptr()) if split else (0, 0, 0))
            launches.append(Launch(
                f"paged_decode_{suffix}_d{d}", (meta.num_decodes, self.decode_ctas_per_row, parts),
                (DECODE_THREADS, 1, 1), decode_smem_bytes(d),
                (out.data_ptr(), *workspace, query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables,
                 meta.decode_context_lens.data_ptr(), i32(h), i32(kvh), block_size_log2, i32(stride), q_stride,
                 i32(meta.num_prefill_tokens), i32(meta.decode_partition_size), i32(parts), scale_log2, window_arg, softcap_log2),
            ))
        return launches

    def _check_inputs(self, query, key, value, key_cache, value_cache, meta, out) -> None:
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        dtype = query.dtype
        _check(dtype in DTYPE_SUFFIX, f"dtype {dtype} is not supported; supported: {list(DTYPE_SUFFIX)}")
        num_tokens = query.shape[0]
        _check(num_tokens == meta.num_tokens, f"query has {num_tokens} rows, the metadata {meta.num_tokens}")
        for name, t, width in (("query", query, h * d), ("key", key, kvh * d), ("value", value, kvh * d),
                               ("out", out, h * d)):
            _check(t.dtype == dtype, f"{name} is {t.dtype}, query is {dtype}")
            _check(t.device == query.device, f"{name} is on {t.device}, query on {query.device}")
            _check(t.dim() == 2 and tuple(t.shape) == (num_tokens, width),
                   f"{name} has shape {tuple(t.shape)}, expected ({num_tokens}, {width})")
            _check(t.stride(1) == 1, f"{name} rows must be contiguous (stride {t.stride()})")
            _check(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0,
                   f"{name} rows must start on 16-byte boundaries (stride {t.stride(0)})")
        _check(out.is_contiguous(), "out must be contiguous")
        expected = (key_cache.shape[0], kvh, meta.block_size, d)
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            _check(cache.dtype == dtype, f"{name} is {cache.dtype}, query is {dtype}")
            _check(cache.device == query.device, f"{name} is on {cache.device}, query on {query.device}")
            _check(tuple(cache.shape) == expected, f"{name} has shape {tuple(cache.shape)}, expected {expected} (HND)")
            _check(cache.is_contiguous() and cache.data_ptr() % 16 == 0, f"{name} must be contiguous and 16-byte aligned")
        for name in ("slot_mapping", "block_tables", "prefill_seqs", "prefill_work", "decode_context_lens",
                     "row_seq", "row_keys"):
            t = getattr(meta, name)
            _check(t.dtype == torch.int32 and t.device == query.device and t.is_contiguous(),
                   f"metadata {name} must be contiguous int32 on {query.device}, got {t.dtype} on {t.device}")
        if dtype in TENSOR_CORE_DTYPES and meta.num_decodes and meta.decode_partitions > 1:
            shape = (meta.num_decodes, h, meta.decode_partitions)
            _check(meta.decode_part_out is not None and tuple(meta.decode_part_out.shape) == shape + (d,)
                   and tuple(meta.decode_part_ml.shape) == shape + (2,)
                   and tuple(meta.decode_counters.shape) == (meta.num_decodes, self.decode_ctas_per_row),
                   "metadata split-K workspace does not match the decode rows and partitions")


def launch_with_cupy(launches: Sequence[Launch], device: torch.device) -> None:
    """Runs the launches in order on torch's current stream of `device`."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _external_stream(index, torch.cuda.current_stream(index).cuda_stream)
    if cupy.cuda.runtime.getDevice() == index:
        _launch_all(launches, index, stream)
    else:
        with cupy.cuda.Device(index):
            _launch_all(launches, index, stream)


def _launch_all(launches: Sequence[Launch], index: int, stream) -> None:
    for launch in launches:
        kernel = _kernel(launch.kernel, index, launch.smem)
        kernel(launch.grid, launch.block, launch.args, shared_mem=launch.smem, stream=stream)


_STREAMS: dict[tuple[int, int], object] = {}


def _external_stream(index: int, pointer: int):
    """CuPy's handle on a torch stream (a wrapper of the pointer, cached: the decode path runs it per layer)."""
    stream = _STREAMS.get((index, pointer))
    if stream is None:
        import cupy

        if len(_STREAMS) > 64:
            _STREAMS.clear()
        stream = _STREAMS[(index, pointer)] = cupy.cuda.ExternalStream(pointer)
    return stream


_MODULE = None
_KERNELS: dict[tuple[int, str], object] = {}
_SMEM_RAISED: dict[tuple[int, str], int] = {}
_LOCK = threading.Lock()


def _kernel(name: str, device_index: int, smem: int):
    """The compiled kernel on the current device (compiled once per process and device, then cached)."""
    key = (device_index, name)
    kernel = _KERNELS.get(key)
    if kernel is None or (smem > STATIC_SMEM_LIMIT and _SMEM_RAISED.get(key, 0) < smem):
        with _LOCK:
            global _MODULE
            import cupy

            if _MODULE is None:
                _MODULE = cupy.RawModule(code=kernel_source(), options=COMPILE_OPTIONS)
            kernel = _KERNELS.get(key) or _MODULE.get_function(name)
            if smem > STATIC_SMEM_LIMIT and _SMEM_RAISED.get(key, 0) < smem:
                kernel.max_dynamic_shared_size_bytes = smem
                _SMEM_RAISED[key] = smem
            _KERNELS[key] = kernel
    return kernel


def load_kernels(device: torch.device | str | int | None = None) -> dict[str, int]:
    """Compiles and loads every kernel on `device` (do it before CUDA-graph capture); returns registers per kernel."""
    import cupy

    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    registers = {}
    with cupy.cuda.Device(index):
        for name in kernel_names():
            smem = 0
            if name.startswith("paged_decode_"):
                smem = decode_smem_bytes(int(name.rsplit("_d", 1)[1]))
            elif name.startswith("paged_prefill_"):
                smem = prefill_smem_bytes(int(name.rsplit("_d", 1)[1]))
            registers[name] = _kernel(name, index, smem).num_regs
    return registers


def supported_reason(device: torch.device | str) -> str | None:
    """None when the CuPy kernels can run on `device`, else why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CuPy build that does not match the driver
        return f"cupy is not importable ({type(exc).__name__}: {exc})"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return f"compute capability {major}.{minor} < 8.0 (bf16 mma.sync and cp.async need sm_80)"
    return None


__all__ = [
    "CupyAttentionMetadata", "CupyPagedAttention", "HostPlan", "Launch", "SUPPORTED_HEAD_DIMS", "SmLimits",
    "decode_slots", "decode_smem_bytes", "default_decode_slots", "kernel_names", "kernel_source", "launch_with_cupy",
    "load_kernels", "plan_batch", "plan_decode_partitions", "prefill_smem_bytes", "resident_ctas", "supported_reason",
]
