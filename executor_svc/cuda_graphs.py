"""CUDA graphs for decode steps: the model's forward captured once per (batch size, context capacity).

A decode step (every row one token) of a small batch is launch-bound: per layer a dozen torch kernels and
two or three attention kernels, each a few microseconds of CPU time to launch for microseconds of GPU
work. Replaying a captured graph launches them all at once.

What is captured: ``model(input_ids, positions, kv_caches, meta)``, embedding through the final norm, for
``size`` rows. Everything it reads lives in static buffers that the capture baked in:

* ``input_ids`` and ``positions``: one int64 buffer each, of the largest captured size; a graph of
  ``size`` rows reads their first ``size`` entries;
* the attention metadata: one CupyAttentionMetadata per graph, built by ``build_metadata(...,
  context_capacity=capacity)`` so that its block tables and split-K plan cover ``capacity`` keys, and
  rewritten in place before each replay by ``refill_metadata`` (it holds the slot mapping too);
* the KV caches: the runner's tensors, allocated once.

A step of ``n`` rows replays the graph of the smallest captured size ``>= n`` and the smallest capacity
``>=`` its longest context; rows ``n .. size`` are padding: token 0 at position 0, a context of one key
in block 0 (whatever it holds: padding outputs are discarded, and every op of the forward is row-wise
outside attention) and cache slot -1, which the cache-write kernel skips. Steps with a prefill chunk, more
rows than the largest size or a context past the largest capacity run eagerly.

Logits are not captured: ``compute_logits`` runs eagerly on the sampling rows of the replayed hidden
states. It is one GEMM, and capturing it would pin a ``[size, vocab]`` float32 buffer per graph (150 MB at
256 rows of a 150k vocabulary) and spend the LM head on padding rows.

The split-K plan of a graph is made for its capacity, not for the step's contexts: a graph cuts contexts
into the partitions the eager path would use for contexts of ``capacity`` keys. Hence more than one
capacity tier: replayed through a graph planned for 32,768 keys, a batch of 2,000-key contexts would fit
in one partition per row and leave most multiprocessors idle (64 rows of a model with 2 KV heads: 128
CTAs), where the eager plan splits each context five ways.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from executor_svc.attention.layout import BatchLayout

DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Context capacities of the captured graphs (each capped at max_model_len); longer decode contexts run
# eagerly, where the step moves enough KV bytes that launch overhead matters little.
CUDA_GRAPH_CONTEXT_TIERS = (2048, 8192)
PADDING_SLOT = -1  # the cache-write kernel skips negative slots
PADDING_BLOCK = 0  # padding rows attend to one key of this block


def cuda_graph_batch_sizes(max_num_seqs: int, requested: Sequence[int] | None = None) -> tuple[int, ...]:
    """The batch sizes to capture, ascending. Default: powers of two up to 256 that are below max_num_seqs,
    plus max_num_seqs itself when it is under 256 (so every decode batch the scheduler can form has a
    graph). Requested sizes above max_num_seqs are dropped: no batch would use them."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    if requested is None:
        sizes = {s for s in DEFAULT_CUDA_GRAPH_BATCH_SIZES if s <= max_num_seqs}
        if max_num_seqs < DEFAULT_CUDA_GRAPH_BATCH_SIZES[-1]:
            sizes.add(max_num_seqs)
    else:
        bad = [s for s in requested if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"cuda_graph_batch_sizes must be positive integers, got {list(requested)}")
        sizes = {s for s in requested if s <= max_num_seqs}
    return tuple(sorted(sizes))


def cuda_graph_context_capacities(max_model_len: int, tiers: Sequence[int] = CUDA_GRAPH_CONTEXT_TIERS) -> tuple[int, ...]:
    """The context capacities to capture, ascending: each tier capped at max_model_len."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    return tuple(sorted({min(t, max_model_len) for t in tiers}))


def select_cuda_graph(
    num_rows: int, max_context: int, sizes: Sequence[int], capacities: Sequence[int]
) -> tuple[int, int] | None:
    """(batch size, capacity) of the graph a decode step replays: the smallest of each that fits; None
    when no captured graph fits (the step runs eagerly). `sizes` and `capacities` ascend."""
    if num_rows < 1:
        return None
    size = next((s for s in sizes if s >= num_rows), None)
    capacity = next((c for c in capacities if c >= max_context), None)
    if size is None or capacity is None:
        return None
    return size, capacity


def pad_decode_layout(layout: BatchLayout, size: int) -> BatchLayout:
    """The decode-only layout grown to `size` rows: each padding row one token over a context of one key in
    PADDING_BLOCK, written to PADDING_SLOT."""
    n = len(layout.query_lens)
    if layout.num_prefills or any(q != 1 for q in layout.query_lens):
        raise ValueError("only decode-only layouts (one token per row) are padded for CUDA graphs")
    if n > size:
        raise ValueError(f"a layout of {n} rows does not fit a graph of {size}")
    pad = size - n
    slots = layout.slot_mapping
    if tuple(slots.shape) != (n,):
        raise ValueError(f"slot_mapping has shape {tuple(slots.shape)} for {n} rows")
    if pad:
        slots = torch.cat([slots, slots.new_full((pad,), PADDING_SLOT)])
    return BatchLayout(
        query_lens=[1] * size,
        context_lens=list(layout.context_lens) + [1] * pad,
        block_tables=list(layout.block_tables) + [[PADDING_BLOCK]] * pad,
        num_prefills=0,
        slot_mapping=slots,
        block_size=layout.block_size,
    )


def padding_layout(size: int, block_size: int, device: torch.device | str) -> BatchLayout:
    """`size` padding rows: what a graph is captured with (nothing is written to the cache)."""
    empty = BatchLayout([], [], [], 0, torch.empty(0, dtype=torch.int64, device=device), block_size)
    return pad_decode_layout(empty, size)


class TorchCudaGraph:
    """One torch.cuda.CUDAGraph: warm-up, then capture (torch.cuda.graph) on one side stream, into a memory
    pool shared by all the runner's graphs; replay on the current stream.

    Warming up on the capture stream itself also creates CuPy's handle on that stream before capture
    (cupy_backend caches one per stream), so nothing but launches happens inside the capture."""

    def __init__(self, pool=None, stream: torch.cuda.Stream | None = None, warmup: int = 2) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.stream = stream if stream is not None else torch.cuda.Stream()
        self.warmup = warmup

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        torch.cuda.synchronize()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup):  # lazy initialisation (cuBLAS workspaces and the like) stays out of the graph
                fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            out = fn()
        torch.cuda.synchronize()
        return out

    def replay(self) -> None:
        self.graph.replay()


@dataclass(slots=True)
class CapturedDecode:
    size: int
    capacity: int
    meta: Any  # CupyAttentionMetadata, refilled in place before each replay
    graph: Any  # TorchCudaGraph (or a stand-in with capture(fn) -> tensor and replay())
    hidden: torch.Tensor  # [size, hidden_size]: the final-norm output each replay writes


class DecodeGraphRunner:
    """Captures and replays the model's decode forward (see the module docstring).

    graph_factory: makes one graph object (capture(fn) -> output tensor, replay()); the default is a
    TorchCudaGraph sharing one memory pool. The CPU tests pass a stand-in that re-runs fn on replay.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attention,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        device: torch.device,
        block_size: int,
        hidden_size: int,
        batch_sizes: Sequence[int],
        context_capacities: Sequence[int],
        graph_factory: Callable[[], Any] | None = None,
    ) -> None:
        if not hasattr(attention, "refill_metadata"):
            raise TypeError(
                f"{type(attention).__name__} cannot serve CUDA graphs: its metadata is not refillable in place"
            )
        if not batch_sizes or not context_capacities:
            raise ValueError("CUDA graphs need at least one batch size and one context capacity")
        if list(batch_sizes) != sorted(set(batch_sizes)) or list(context_capacities) != sorted(set(context_capacities)):
            raise ValueError("batch sizes and context capacities must be strictly ascending")
        self.model = model
        self.attention = attention
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.block_size = block_size
        self.hidden_size = hidden_size
        self.batch_sizes = tuple(batch_sizes)
        self.context_capacities = tuple(context_capacities)
        if graph_factory is None:
            pool = torch.cuda.graph_pool_handle()
            graph_factory = functools.partial(TorchCudaGraph, pool, torch.cuda.Stream(self.device))
        self.graph_factory = graph_factory
        max_size = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=self.device)
        self.graphs: dict[tuple[int, int], CapturedDecode] = {}
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every (size, capacity), largest first so that smaller graphs reuse the pool's memory."""
        for size in reversed(self.batch_sizes):
            for capacity in reversed(self.context_capacities):
                layout = padding_layout(size, self.block_size, self.device)
                meta = self.attention.build_metadata(layout, self.device, context_capacity=capacity)
                assert meta.num_tokens == size and meta.num_decodes == size and meta.num_prefills == 0
                assert meta.table_stride * self.block_size >= capacity
                assert meta.decode_partitions * meta.decode_partition_size >= capacity
                graph = self.graph_factory()
                forward = functools.partial(
                    self.model, self.input_ids[:size], self.positions[:size], self.kv_caches, meta
                )
                hidden = graph.capture(forward)
                assert tuple(hidden.shape) == (size, self.hidden_size), (tuple(hidden.shape), size)
                self.graphs[(size, capacity)] = CapturedDecode(size, capacity, meta, graph, hidden)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor | None:
        """Hidden states [n, hidden_size] of a decode-only step through a replayed graph, or None when no
        captured graph serves the step (the caller runs it eagerly). The result is valid until the next
        replay of any of the runner's graphs."""
        n = len(layout.query_lens)
        if layout.num_prefills or n == 0:
            return None
        key = select_cuda_graph(n, max(layout.context_lens), self.batch_sizes, self.context_capacities)
        if key is None or key not in self.graphs:
            return None
        if tuple(input_ids.shape) != (n,) or tuple(positions.shape) != (n,):
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} for {n} rows")
        entry = self.graphs[key]
        self.attention.refill_metadata(entry.meta, pad_decode_layout(layout, entry.size))
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n : entry.size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n : entry.size].zero_()
        entry.graph.replay()
        self.num_replays += 1
        return entry.hidden[:n]
