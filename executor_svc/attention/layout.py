"""The shape of one step's flat batch, as every attention backend receives it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class BatchLayout:
    """Sequences in row order: the first ``num_prefills`` are multi-token chunks, the rest one-token rows.

    Sequence i owns rows ``[sum(query_lens[:i]), sum(query_lens[:i + 1]))`` of the flat batch; its queries
    are its last ``query_lens[i]`` positions out of ``context_lens[i]``, whose K/V live in the blocks of
    ``block_tables[i]`` (after this step's write).
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # each covers at least ceil(context_len / block_size) blocks
    num_prefills: int
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the device: where each row's K/V is written
    block_size: int

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.query_lens[: self.num_prefills])
