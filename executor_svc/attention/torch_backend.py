"""Paged attention in plain torch: the CPU backend and the reference the CUDA kernels are checked against.

The flat batch holds prefill chunks first, then single-token rows (decodes, and prefill chunks of one
token). Each layer's cache is ``[num_blocks, num_kv_heads, block_size, head_dim]`` (HND): one KV head of
one block is a contiguous ``block_size x head_dim`` tile, which is what a GPU thread block serving one KV
head reads, and what lets the CPU path multiply gathered blocks without re-laying them out. Position p of
a request lives in block ``table[p // block_size]`` at offset ``p % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from executor_svc.attention.layout import BatchLayout

# A decode group grows while its longest context stays within this factor of its shortest (plus a
# block): padding every row to the group's longest context wastes at most this much attention work.
DECODE_GROUP_PAD_FACTOR = 1.25


@dataclass(slots=True)
class PrefillSegment:
    query_start: int  # rows [query_start, query_end) of the flat batch
    query_end: int
    context_len: int  # keys this chunk attends to: cached context + the chunk itself
    block_ids: torch.Tensor | None  # int64 blocks holding positions [0, context_len); None: no cached context
    # [num_queries, context_len] float32, 0 or -inf: query i sits at position context_len - n + i and
    # sees keys at positions <= it (the causal rule aligned bottom-right, for chunks).
    bias: torch.Tensor
    windowed_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # the same with a sliding window, by window

    def bias_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.bias
        if window not in self.windowed_bias:
            self.windowed_bias[window] = causal_bias(self.query_end - self.query_start, self.context_len,
                                                     window).to(self.bias.device)
        return self.windowed_bias[window]


@dataclass(slots=True)
class DecodeGroup:
    row_start: int  # rows [row_start, row_start + rows) of the flat batch
    block_tables: torch.Tensor  # [rows, max_blocks] int64, padded with block 0
    bias: torch.Tensor  # [rows, 1, 1, max_blocks * block_size] float32: 0 below the context length, else -inf
    context_lens: torch.Tensor  # [rows] int64
    windowed_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # also -inf before the window, by window

    def bias_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.bias
        if window not in self.windowed_bias:
            key_positions = torch.arange(self.bias.shape[-1], device=self.bias.device)
            before = key_positions[None, :] < (self.context_lens[:, None] - window)
            self.windowed_bias[window] = self.bias.masked_fill(before[:, None, None, :], float("-inf"))
        return self.windowed_bias[window]


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each token's K/V
    prefills: list[PrefillSegment]
    num_prefill_tokens: int
    # Single-token rows, grouped so that each group pads its contexts to a similar length.
    decode_groups: list[DecodeGroup]


# Queries per matmul in prefill attention: bounds the score matrix to QUERY_TILE x context per head.
QUERY_TILE = 256


def causal_bias(num_queries: int, context_len: int, window: int | None = None) -> torch.Tensor:
    """With a sliding window, a query at position p sees only the keys at (p - window, p]."""
    key_pos = torch.arange(context_len)
    query_pos = torch.arange(context_len - num_queries, context_len)
    hidden = key_pos[None, :] > query_pos[:, None]
    if window is not None:
        hidden |= key_pos[None, :] <= query_pos[:, None] - window
    return torch.zeros(num_queries, context_len).masked_fill_(hidden, float("-inf"))


class TorchPagedAttention:
    """Attention as two matmuls per KV head with a float32 softmax between them.

    Each KV head's query group is folded into the rows of one matmul, so K/V are read once per KV head
    (no repeat for GQA); on CPUs this beats scaled_dot_product_attention for decode (one query row over
    a masked context) and for bfloat16.
    """

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> AttentionMetadata:
        segments, start = [], 0
        for i in range(layout.num_prefills):
            n, context_len = layout.query_lens[i], layout.context_lens[i]
            block_ids = None
            if context_len > n:
                num_blocks = -(-context_len // layout.block_size)
                block_ids = torch.as_tensor(layout.block_tables[i][:num_blocks], device=device)
            bias = causal_bias(n, context_len).to(device)
            segments.append(PrefillSegment(start, start + n, context_len, block_ids, bias))
            start += n

        groups, first = [], layout.num_prefills
        num_seqs = len(layout.query_lens)
        while first < num_seqs:
            end = first + 1
            limit = layout.context_lens[first] * DECODE_GROUP_PAD_FACTOR + layout.block_size
            while end < num_seqs and layout.context_lens[end] <= limit:
                end += 1
            groups.append(_decode_group(layout, first, end, start + first - layout.num_prefills, device))
            first = end
        return AttentionMetadata(layout.slot_mapping, segments, start, groups)

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads * head_dim]
        key: torch.Tensor,  # [T, num_kv_heads * head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,  # a sliding window: a query at position p sees the keys at (p - window, p]
        softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) before the mask
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_dim)
        k = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        write_cache(key_cache, value_cache, k, v, meta.slot_mapping)

        out = torch.empty_like(q)
        for seg in meta.prefills:
            if seg.block_ids is None:
                # A whole prompt in one chunk: its K/V are this step's own, no gather needed.
                keys = k[seg.query_start : seg.query_end].transpose(0, 1)
                values = v[seg.query_start : seg.query_end].transpose(0, 1)
            else:
                keys = _gather(key_cache, seg.block_ids, seg.context_len)
                values = _gather(value_cache, seg.block_ids, seg.context_len)
            seg_bias = seg.bias_for(window)
            for tile in range(seg.query_start, seg.query_end, QUERY_TILE):
                tile_end = min(tile + QUERY_TILE, seg.query_end)
                bias = seg_bias[tile - seg.query_start : tile_end - seg.query_start]
                out[tile:tile_end] = self._prefill_tile(q[tile:tile_end], keys, values, bias, softcap)
        for group in meta.decode_groups:
            rows = slice(group.row_start, group.row_start + group.block_tables.shape[0])
            out[rows] = self._decode(q[rows], key_cache, value_cache, group, group.bias_for(window), softcap)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _scores(self, scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
        scores = scores * self.scale
        return scores if softcap is None else torch.tanh(scores / softcap) * softcap

    def _prefill_tile(self, q, keys, values, bias, softcap) -> torch.Tensor:
        n, kvh, g, d = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        # [n, H, D] -> [KVH, G*n, D]: query head h = kv_head * G + g, as transformers' repeat_kv has it.
        grouped = q.view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * n, d)
        scores = torch.matmul(grouped, keys.transpose(1, 2)).float().view(kvh, g, n, -1)
        probs = (self._scores(scores, softcap) + bias).softmax(-1).to(q.dtype).view(kvh, g * n, -1)
        out = torch.matmul(probs, values)  # [KVH, G*n, D]
        return out.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, self.num_heads, d)

    def _decode(self, q, key_cache, value_cache, group: DecodeGroup, bias: torch.Tensor, softcap) -> torch.Tensor:
        rows, max_blocks = group.block_tables.shape
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        block_size = key_cache.shape[2]
        keys = key_cache[group.block_tables]  # [rows, max_blocks, KVH, block_size, D]
        values = value_cache[group.block_tables]
        # Scores block by block: the query broadcasts over blocks, so the gathered tiles are used in place.
        scores = torch.matmul(q.view(rows, 1, kvh, g, d), keys.transpose(-1, -2)).float()  # [rows, blocks, KVH, G, bs]
        scores = scores.permute(0, 2, 3, 1, 4).reshape(rows, kvh, g, max_blocks * block_size)
        probs = (self._scores(scores, softcap) + bias).softmax(-1).to(q.dtype)
        probs = probs.view(rows, kvh, g, max_blocks, block_size).permute(0, 3, 1, 2, 4)
        out = torch.matmul(probs, values).sum(1)  # [rows, KVH, G, D]
        return out.reshape(rows, self.num_heads, d)


def _decode_group(layout: BatchLayout, first: int, end: int, row_start: int, device) -> DecodeGroup:
    context_lens = np.asarray(layout.context_lens[first:end], dtype=np.int64)
    max_blocks = int(-(-context_lens.max() // layout.block_size))
    tables = np.zeros((end - first, max_blocks), dtype=np.int64)
    for row, table in enumerate(layout.block_tables[first:end]):
        held = table[:max_blocks]
        tables[row, : len(held)] = held
    key_positions = np.arange(max_blocks * layout.block_size)
    bias = np.where(key_positions[None, :] < context_lens[:, None], 0.0, -np.inf).astype(np.float32)
    return DecodeGroup(
        row_start, torch.from_numpy(tables).to(device), torch.from_numpy(bias).to(device)[:, None, None, :],
        torch.from_numpy(context_lens).to(device),
    )


def write_cache(key_cache, value_cache, key, value, slot_mapping) -> None:
    """Scatters the step's K/V ([T, KVH, D]) into their slots (slot = block * block_size + offset)."""
    block_size = key_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, :, offsets] = key
    value_cache[blocks, :, offsets] = value


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, context_len: int) -> torch.Tensor:
    """[KVH, context_len, D]: a request's first context_len positions, read through its block table."""
    tiles = cache[block_ids]  # [blocks, KVH, block_size, D]
    return tiles.transpose(0, 1).flatten(1, 2)[:, :context_len]
