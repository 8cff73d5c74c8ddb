"""Float64 references for the CUDA kernels, in plain torch and written for clarity.

Each function follows the definition directly (position p -> block table[p // block_size], offset
p % block_size, as one indexing operation over all positions), so it shares no indexing code with the
kernels or with TorchPagedAttention; the CPU tests check these references against TorchPagedAttention,
and the GPU tests check every kernel against them.

Cache layout (HND): ``[num_blocks, num_kv_heads, block_size, head_dim]``; position p of a sequence lives
in block ``table[p // block_size]`` at offset ``p % block_size``. Query head h reads KV head
``h // (num_heads // num_kv_heads)``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def cache_write_reference(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with token t's K/V ([T, KVH * D] or [T, KVH, D]) at slot_mapping[t]; negative slots skipped."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    num_kv_heads, block_size, head_dim = key_cache.shape[1:]
    slots = slot_mapping.cpu().long()
    written = slots >= 0
    blocks, offsets = slots[written] // block_size, slots[written] % block_size
    key_cache[blocks, :, offsets] = key.reshape(key.shape[0], num_kv_heads, head_dim)[written]
    value_cache[blocks, :, offsets] = value.reshape(value.shape[0], num_kv_heads, head_dim)[written]
    return key_cache, value_cache


def gather_context(cache: torch.Tensor, block_table: Sequence[int], context_len: int) -> torch.Tensor:
    """[context_len, KVH, D] float64: positions 0..context_len-1 of one sequence."""
    block_size = cache.shape[2]
    positions = torch.arange(context_len)
    blocks = torch.as_tensor(list(block_table), dtype=torch.long)[positions // block_size]
    return cache[blocks, :, positions % block_size].double()  # [context_len, KVH, D]


def paged_attention_reference(
    query: torch.Tensor,  # [T, H * D] or [T, H, D]: sequences' query rows back to back
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """[T, H, D] float64: each query at position p attends to its sequence's keys at positions <= p (with a
    sliding window, only those at positions > p - window); with softcap, the scaled scores s become
    softcap * tanh(s / softcap).

    Sequence i's n = query_lens[i] queries sit at positions context_lens[i] - n .. context_lens[i] - 1, so
    one-token rows are decodes over the whole context and longer chunks see the cached context plus their
    own chunk causally (the mask aligned bottom-right).
    """
    num_kv_heads, _, head_dim = key_cache.shape[1:]
    q = query.reshape(query.shape[0], -1, head_dim).double()
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    kv_of_head = torch.arange(num_heads) // group
    out = torch.empty_like(q)
    row = 0
    for n, context_len, table in zip(query_lens, context_lens, block_tables):
        # Keys from the first query's window on (what a windowed sequence's cache still needs to hold).
        start = 0 if window is None else max(0, context_len - n - window + 1)
        keys = gather_context(key_cache, table, context_len)[start:, kv_of_head]  # [keys, H, D]
        values = gather_context(value_cache, table, context_len)[start:, kv_of_head]
        positions = torch.arange(context_len - n, context_len)
        scores = torch.einsum("nhd,khd->hnk", q[row : row + n], keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        key_positions = torch.arange(start, context_len)[None, :]
        hidden = key_positions > positions[:, None]  # [n, ctx]: keys after the query
        if window is not None:
            hidden |= key_positions <= positions[:, None] - window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[row : row + n] = torch.einsum("hnk,khd->nhd", scores.softmax(-1), values)
        row += n
    return out


def paged_decode_reference(query, key_cache, value_cache, context_lens, block_tables, scale) -> torch.Tensor:
    """[N, H, D] float64: one query per sequence over its whole context."""
    return paged_attention_reference(
        query, key_cache, value_cache, [1] * len(context_lens), context_lens, block_tables, scale
    )


class PagedProblem:
    """Random inputs of one attention step over a paged cache, for checking a backend against the references.

    Block tables draw from a shuffled pool (and list one spare block past what the context needs), so
    neighbouring positions rarely share neighbouring blocks. ``query``, ``key`` and ``value`` are column
    slices of one fused ``[T, (H + 2 * KVH) * D]`` tensor, as the model produces them (rows not dense).
    With ``poison`` the cache holds NaN everywhere a kernel must not read or must overwrite first: past
    each context, in unused blocks, in the slots this step writes, and with a sliding ``window`` before the
    window of each sequence's first query.
    """

    def __init__(
        self, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, query_lens: Sequence[int],
        cached_lens: Sequence[int], num_prefills: int, dtype: torch.dtype, device: str | torch.device = "cpu",
        seed: int = 0, poison: bool = True, spare_blocks: int = 3, window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.num_prefills, self.dtype, self.window = block_size, num_prefills, dtype, window
        self.softcap = softcap
        self.query_lens = list(query_lens)
        self.context_lens = [c + n for c, n in zip(cached_lens, query_lens)]
        self.scale = head_dim**-0.5
        needed = [-(-ctx // block_size) for ctx in self.context_lens]
        num_blocks = sum(needed) + spare_blocks
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables, taken = [], 0
        for n_blocks in needed:
            spare = int(torch.randint(num_blocks, (1,), generator=gen))
            self.block_tables.append(pool[taken : taken + n_blocks] + [spare])
            taken += n_blocks
        slots = [
            table[p // block_size] * block_size + p % block_size
            for n, ctx, table in zip(self.query_lens, self.context_lens, self.block_tables)
            for p in range(ctx - n, ctx)
        ]
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        key_cache = torch.randn(shape, generator=gen)
        value_cache = torch.randn(shape, generator=gen)
        if poison:
            live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
            for n, ctx, table in zip(self.query_lens, self.context_lens, self.block_tables):
                # Cached positions hold data (from the first query's window on); everything else is NaN.
                cached = torch.arange(0 if window is None else max(0, ctx - n - window + 1), ctx - n)
                live[torch.as_tensor(table)[cached // block_size] * block_size + cached % block_size] = True
            dead = ~live.view(num_blocks, 1, block_size, 1).expand(shape)
            key_cache[dead] = float("nan")
            value_cache[dead] = float("nan")
        num_tokens = sum(self.query_lens)
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
        self.qkv = qkv.to(dtype=dtype, device=device)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.query, self.key, self.value = self.qkv.split([q_size, kv_size, kv_size], dim=-1)
        self.key_cache = key_cache.to(dtype=dtype, device=device)
        self.value_cache = value_cache.to(dtype=dtype, device=device)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)

    def layout(self):
        from executor_svc.attention.layout import BatchLayout

        return BatchLayout(
            query_lens=list(self.query_lens), context_lens=list(self.context_lens),
            block_tables=[list(t) for t in self.block_tables], num_prefills=self.num_prefills,
            slot_mapping=self.slot_mapping, block_size=self.block_size,
        )

    def expected(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(attention output [T, H, D], key cache, value cache) after the step, float64 / cache dtype, on the CPU."""
        key_cache, value_cache = cache_write_reference(
            self.key_cache.cpu(), self.value_cache.cpu(), self.key.cpu(), self.value.cpu(), self.slot_mapping.cpu()
        )
        out = paged_attention_reference(
            self.query.cpu(), key_cache, value_cache, self.query_lens, self.context_lens, self.block_tables, self.scale,
            self.window, self.softcap,
        )
        return out, key_cache, value_cache
