"""The request-level API on top of the block pool: each request's block table, grown as its tokens grow.

The scheduler calls ``step`` once per engine step with every free and every allocation of that step, so
the cost of talking to this manager (in-process or over gRPC) does not grow with the batch size.
"""
from __future__ import annotations

from collections.abc import Iterable

from kvcache_svc.block_pool import BlockPool, KVBlock
from pagedserve.step import BlockRequest, BlockStepRequest, BlockStepResult


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}
        # Largest num_tokens slotted per request: tells whether its last block has room for one more token.
        self.num_tokens: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_requests(self) -> int:
        return len(self.block_tables)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.block_tables.get(request_id, ())]

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        num_held = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grows the request's table to hold num_tokens; returns the new block ids, or None (and changes
        nothing) when the pool cannot supply all of them. An unknown request_id is admitted."""
        if not self.can_allocate(request_id, num_tokens):
            return None
        new_blocks = self.block_pool.get_new_blocks(self.num_blocks_needed(request_id, num_tokens))
        self.block_tables.setdefault(request_id, []).extend(new_blocks)
        self.num_tokens[request_id] = max(self.num_tokens.get(request_id, 0), num_tokens)
        return [block.block_id for block in new_blocks]

    def free(self, request_id: str) -> None:
        """Returns the request's blocks and forgets it; an unknown id is ignored, since an abort can race
        the request's finish."""
        blocks = self.block_tables.pop(request_id, [])
        self.num_tokens.pop(request_id, None)
        # Reversed, so that the pool evicts the request's tail before its (more shareable) prefix.
        self.block_pool.free_blocks(reversed(blocks))

    def can_grow_all(self, request_ids: Iterable[str]) -> bool:
        """Whether every one of these requests can append one token: those whose last block is full (or
        who hold none) need one fresh block each."""
        num_needed = sum(self.num_blocks_needed(rid, self.num_tokens.get(rid, 0) + 1) for rid in request_ids)
        return num_needed <= self.num_free_blocks

    def step(self, step_request: BlockStepRequest) -> BlockStepResult:
        for request_id in step_request.free_request_ids:
            self.free(request_id)
        result = BlockStepResult()
        for request in step_request.requests:
            served = self._serve(request)
            if served is None:
                result.failed_request_ids.append(request.request_id)
                continue
            new_block_ids, num_cached_tokens = served
            result.new_block_ids[request.request_id] = new_block_ids
            if request.prompt_token_ids is not None:
                result.num_cached_tokens[request.request_id] = num_cached_tokens
        result.num_free_blocks = self.num_free_blocks
        return result

    def _serve(self, request: BlockRequest) -> tuple[list[int], int] | None:
        """Slots one request, all-or-nothing: its new block ids and the number of leading prompt tokens
        already cached, or None. Prefix caching attaches here, on admission (prompt_token_ids set):
        matched blocks are touched into the table before fresh ones are allocated. Without a prefix
        index every prompt token is computed, so the cached count is 0."""
        new_block_ids = self.allocate(request.request_id, request.num_tokens)
        return None if new_block_ids is None else (new_block_ids, 0)

    def stats(self) -> dict[str, int | float]:
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_in_use": self.block_pool.num_in_use,
            "num_cached_evictable": self.block_pool.num_cached_evictable,
            "num_requests": self.num_requests,
            "usage": self.usage,
        }
