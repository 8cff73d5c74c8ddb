"""The request-level API on top of the block pool: each request's block table, grown as its tokens grow.

The scheduler calls ``step`` once per engine step with every free and every allocation of that step, so
the cost of talking to this manager (in-process or over gRPC) does not grow with the batch size.

With prefix caching (on by default) every full block is indexed under its chained hash as soon as the
step that computes it is scheduled; an admitted request starts from the longest run of leading blocks
already in the pool, referenced rather than recomputed. Its last prompt token is always computed, since
its logits are needed. Unreferenced cached blocks stay in the free queue and are evicted LRU.

With an offload tier, a cached block about to be evicted is first copied out (``saves_before``), and,
when asked, every block as it fills (``saves_after``); a prefix that runs out in the pool continues in
the tier, and those blocks are loaded into fresh blocks instead of recomputed (``tier_loads``). This
manager decides what moves; the executor moves the bytes.
"""
from __future__ import annotations

from collections.abc import Iterable

from kvcache_svc.block_hash import block_hash, root_hash
from kvcache_svc.block_pool import BlockPool, KVBlock
from kvcache_svc.offload_index import LocalTierIndex
from pagedserve.step import BlockRequest, BlockStepRequest, BlockStepResult, BlockTransfer


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 model_id: str = "", tier: LocalTierIndex | None = None, write_through: bool = False,
                 block_bytes: int = 0) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}
        # Largest num_tokens slotted per request: tells whether its last block has room for one more token.
        self.num_tokens: dict[str, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash(f"{model_id}|block_size={block_size}")
        # Per admitted request: its known tokens, the hashes of its full blocks so far, its cache salt.
        self.token_ids: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[bytes]] = {}
        self.cache_salts: dict[str, str | None] = {}
        self.prefix_queries = 0  # prompt tokens of admitted requests
        self.prefix_hits = 0  # of those, tokens found already computed (in the pool or the tier)
        self.tier = tier if enable_prefix_caching else None
        self.write_through = write_through and self.tier is not None
        self.tier_hits = 0  # tokens loaded from the tier instead of recomputed
        self.blocks_saved = 0
        self.block_bytes = block_bytes  # one block's K/V, all layers: for the bytes-moved count
        # Filled while serving one step, handed out with its result.
        self._tier_loads: dict[str, list[BlockTransfer]] = {}
        self._filled: list[BlockTransfer] = []

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
        self.token_ids.pop(request_id, None)
        self.block_hashes.pop(request_id, None)
        self.cache_salts.pop(request_id, None)
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
        self._collect_transfers(result)
        return result

    def _collect_transfers(self, result: BlockStepResult) -> None:
        evicted, self.block_pool.evicted = self.block_pool.evicted, []
        filled, self._filled = self._filled, []
        result.tier_loads, self._tier_loads = self._tier_loads, {}
        if self.tier is None:
            return
        result.saves_before = [BlockTransfer(block_id, block_hash) for block_id, block_hash in evicted]
        if self.write_through:
            result.saves_after = filled
        saved = result.saves_before + result.saves_after
        self.tier.record([t.block_hash for t in saved])
        self.blocks_saved += len(saved)

    def _serve(self, request: BlockRequest) -> tuple[list[int], int] | None:
        """Slots one request, all-or-nothing: its new block ids and, on admission, the number of leading
        prompt tokens already cached; None when the pool cannot supply the blocks."""
        if request.prompt_token_ids is not None:
            return self._admit(request)
        if request.new_token_ids and request.request_id in self.token_ids:
            self.token_ids[request.request_id].extend(request.new_token_ids)
        new_block_ids = self.allocate(request.request_id, request.num_tokens)
        if new_block_ids is None:
            return None
        self._cache_full_blocks(request.request_id)
        return new_block_ids, 0

    def _admit(self, request: BlockRequest) -> tuple[list[int], int] | None:
        request_id, tokens, bs = request.request_id, list(request.prompt_token_ids), self.block_size
        self.free(request_id)  # a re-admission starts over
        hits, hashes, num_tier = self._cached_prefix(tokens, request.cache_salt)
        num_cached = (len(hits) + num_tier) * bs
        # num_tokens counts from zero; the cached prefix moves the chunk forward, up to the known tokens.
        end = min(num_cached + request.num_tokens, len(tokens))
        num_new = -(-end // bs) - len(hits)
        # A hit nobody holds sits in the free queue: taking it leaves one block fewer to allocate.
        if num_new > self.num_free_blocks - sum(1 for block in hits if block.ref_cnt == 0):
            return None
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        self.block_tables[request_id] = hits + new_blocks
        self.num_tokens[request_id] = end
        self.token_ids[request_id] = tokens
        self.block_hashes[request_id] = hashes[: len(hits)]
        self.cache_salts[request_id] = request.cache_salt
        self.prefix_queries += len(tokens)
        self.prefix_hits += num_cached
        if num_tier:
            # The first fresh blocks take the tier's copies; they are indexed as full blocks below.
            tier_hashes = hashes[len(hits) : len(hits) + num_tier]
            self._tier_loads[request_id] = [
                BlockTransfer(block.block_id, block_hash) for block, block_hash in zip(new_blocks, tier_hashes)
            ]
            self.tier_hits += num_tier * bs
        self._cache_full_blocks(request_id)
        if num_tier:  # the tier has these already: no write-through for them
            loaded = {t.block_id for t in self._tier_loads[request_id]}
            self._filled = [t for t in self._filled if t.block_id not in loaded]
        return [block.block_id for block in hits + new_blocks], num_cached

    def _cached_prefix(self, tokens: list[int], salt: str | None) -> tuple[list[KVBlock], list[bytes], int]:
        """The longest run of leading full blocks already in the pool, how many of the blocks after them
        the tier holds, and the hashes of both runs (pool hits first)."""
        if not self.enable_prefix_caching:
            return [], [], 0
        hits, hashes, parent, bs = [], [], self.root_hash, self.block_size
        num_full = (len(tokens) - 1) // bs  # the last token is always computed
        for i in range(num_full):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], salt if i == 0 else None)
            hashes.append(parent)
            block = self.block_pool.get_cached_block(parent)
            if block is None:
                break
            hits.append(block)
        if self.tier is None or len(hits) == num_full:
            return hits, hashes[: len(hits)], 0
        for i in range(len(hashes), num_full):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], None)
            hashes.append(parent)
        num_tier = self.tier.leading_count(hashes[len(hits) :])
        return hits, hashes[: len(hits) + num_tier], num_tier

    def _cache_full_blocks(self, request_id: str) -> None:
        """Indexes the request's blocks that this step fills completely with known tokens."""
        tokens = self.token_ids.get(request_id)
        if not self.enable_prefix_caching or tokens is None:
            return
        hashes, blocks, bs = self.block_hashes[request_id], self.block_tables[request_id], self.block_size
        salt = self.cache_salts[request_id]
        num_full = min(self.num_tokens[request_id], len(tokens)) // bs
        parent = hashes[-1] if hashes else self.root_hash
        for i in range(len(hashes), num_full):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], salt if i == 0 else None)
            if blocks[i].block_hash is None and self.block_pool.cache_full_block(blocks[i], parent):
                self._filled.append(BlockTransfer(blocks[i].block_id, parent))
            hashes.append(parent)

    def stats(self) -> dict[str, int | float]:
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_in_use": self.block_pool.num_in_use,
            "num_cached_evictable": self.block_pool.num_cached_evictable,
            "num_requests": self.num_requests,
            "usage": self.usage,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "evictions": self.block_pool.num_evictions,
            "tier_hits": self.tier_hits,
            "blocks_saved": self.blocks_saved,
            "bytes_moved": (self.blocks_saved + self.tier_hits // self.block_size) * self.block_bytes,
            **(self.tier.stats() if self.tier is not None else {"tier_index_blocks": 0, "tier_errors": 0}),
        }
