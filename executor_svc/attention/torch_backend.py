"""Paged attention in plain torch: the CPU backend and the reference the CUDA kernels are checked against.

The flat batch holds prefill chunks first, then single-token rows (decodes, and prefill chunks of one
token). Each layer's cache is ``[num_blocks, block_size, num_kv_heads, head_dim]``; a request's K/V lives
in the blocks its block table names, position p at block ``table[p // block_size]``, offset
``p % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    query_start: int  # rows [query_start, query_end) of the flat batch
    query_end: int
    context_len: int  # keys this chunk attends to: cached context + the chunk itself
    block_ids: torch.Tensor | None  # int64 blocks holding positions [0, context_len); None: no cached context


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each token's K/V
    prefills: list[PrefillSegment]
    num_prefill_tokens: int
    # Single-token rows, grouped so that each group pads its contexts to a similar length.
    decode_groups: list["DecodeGroup"]


@dataclass(slots=True)
class DecodeGroup:
    row_start: int  # rows [row_start, row_start + len(context_lens)) of the flat batch
    block_tables: torch.Tensor  # [rows, max_blocks] int64, padded with block 0
    key_mask: torch.Tensor  # [rows, 1, 1, max_blocks * block_size] bool: key position < context length


class TorchPagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads * head_dim]
        key: torch.Tensor,  # [T, num_kv_heads * head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_dim)
        k = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        value_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        for seg in meta.prefills:
            out[seg.query_start : seg.query_end] = self._prefill(q, k, v, key_cache, value_cache, seg)
        for group in meta.decode_groups:
            rows = slice(group.row_start, group.row_start + group.block_tables.shape[0])
            out[rows] = self._decode(q[rows], key_cache, value_cache, group)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _prefill(self, q, k, v, key_cache, value_cache, seg: PrefillSegment) -> torch.Tensor:
        num_queries = seg.query_end - seg.query_start
        query = q[seg.query_start : seg.query_end].transpose(0, 1)  # [H, n, D]
        if seg.block_ids is None:
            # A whole prompt in one chunk: its K/V are this step's own, no gather needed.
            keys = k[seg.query_start : seg.query_end]
            values = v[seg.query_start : seg.query_end]
            mask, causal = None, True
        else:
            keys = _gather(key_cache, seg.block_ids, seg.context_len)
            values = _gather(value_cache, seg.block_ids, seg.context_len)
            # Bottom-right causal: query i sits at position context_len - n + i and sees keys <= it.
            first_query_pos = seg.context_len - num_queries
            query_pos = torch.arange(first_query_pos, seg.context_len).unsqueeze(1)
            mask, causal = torch.arange(seg.context_len).unsqueeze(0) <= query_pos, False
        out = F.scaled_dot_product_attention(
            query, keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True,
        )
        return out.transpose(0, 1)

    def _decode(self, q, key_cache, value_cache, group: DecodeGroup) -> torch.Tensor:
        rows, max_blocks = group.block_tables.shape
        max_len = max_blocks * key_cache.shape[1]
        keys = key_cache[group.block_tables].view(rows, max_len, self.num_kv_heads, self.head_dim)
        values = value_cache[group.block_tables].view(rows, max_len, self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [rows, H, 1, D]
            keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=group.key_mask, scale=self.scale, enable_gqa=True,
        )
        return out.squeeze(2)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, context_len: int) -> torch.Tensor:
    return cache[block_ids].flatten(0, 1)[:context_len]
