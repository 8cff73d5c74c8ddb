"""The request-level API on top of the block pool, and the one authority on block arithmetic.

The scheduler calls ``step`` once per engine step with every free and its candidates in priority order:
the running requests (highest priority first) with the slots each needs by the end of the step, then the
waiting requests it would like to admit. The manager serves the running ones in order; when the pool
cannot give one its blocks, the lowest-priority running candidate (the tail) gives all of its blocks back
and is reported preempted, until the request fits or is itself the one preempted. So preemption is
last-in-first-out by construction and the scheduler never predicts a block count. Waiting requests are
admitted in order, only if nobody was preempted this step, up to the first that does not fit.

With prefix caching (on by default) every full block is indexed under its chained hash once the step that
computes it has run: the call that plans a step names the blocks it fills with known tokens, and a later
call, which lists the steps the executor ran since the call before it (and which requests of them failed),
indexes them, or gives the names up when their step never ran (the blocks are named again by the next
call). With steps planned ahead that later call comes two calls on. So the index never names a block whose
KV was not computed. When the executor is replaced (a new epoch) every block it held is dropped from the
index, and when the scheduler is, every request it had. An admitted request starts from the longest run of
leading blocks already in the pool, referenced rather than recomputed. Its last prompt token is always
computed, since its logits are needed. Unreferenced cached blocks stay in the free queue and are evicted LRU.

With an offload tier, a cached block about to be evicted is first copied out (``saves_before``), and,
when asked, every block as it fills (``saves_after``); a prefix that runs out in the pool continues in
the tier, and those blocks are loaded into fresh blocks instead of recomputed (``tier_loads``). This
manager decides what moves; the executor moves the bytes.
"""
from __future__ import annotations

from kvcache_svc.block_hash import block_hash, root_hash
from kvcache_svc.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvcache_svc.offload_index import LocalTierIndex
from pagedserve.step import BlockRequest, BlockStepRequest, BlockStepResult, BlockTransfer


class RequestBlocks:
    """One request as the manager knows it: its block table and what prefix caching needs to name it."""

    __slots__ = ("blocks", "num_tokens", "token_ids", "block_hashes", "cache_salt", "num_blocks_sent", "num_named",
                 "last_name", "naming_round")

    def __init__(self, blocks: list[KVBlock], num_tokens: int, token_ids: list[int], cache_salt: str | None):
        self.blocks = blocks
        self.num_tokens = num_tokens  # slots in use once the step served last has run
        self.token_ids = token_ids  # every token known so far (prompt, then sampled ones)
        self.block_hashes: list[bytes] = []  # of the leading full blocks indexed so far (their step ran)
        self.cache_salt = cache_salt
        # Leading full blocks named, indexed or waiting for their step to run; the hash of the last one of
        # those (the parent of the next name); and a count bumped when waiting names are given up, which
        # voids them (their blocks are named again, from the last indexed one).
        self.num_named = 0
        self.last_name: bytes | None = None
        self.naming_round = 0
        # Leading blocks of the table the scheduler is known to have received; the rest travel (again) with
        # the next answer, so that an answer lost on the way loses no block.
        self.num_blocks_sent = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 model_id: str = "", tier: LocalTierIndex | None = None, write_through: bool = False,
                 block_bytes: int = 0) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.requests: dict[str, RequestBlocks] = {}
        # The scheduler and executor instances the pool's state belongs to (None until the first step).
        self.scheduler_id: str | None = None
        self.executor_epoch: str | None = None
        # Per call whose step is not known to have run yet (by step id): the full blocks it named, indexed
        # once it has: (request id, its state, block index in its table, hash, the state's naming round).
        self._unconfirmed: dict[int, list[tuple[str, RequestBlocks, int, bytes, int]]] = {}
        self._last_step_id: int | None = None
        self._previous_step_id: int | None = None
        self._served_last: list[RequestBlocks] = []  # whose blocks the last answer carried
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash(f"{model_id}|block_size={block_size}")
        self.prefix_queries = 0  # prompt tokens of admitted requests
        self.prefix_hits = 0  # of those, tokens found already computed (in the pool or the tier)
        self.num_preemptions = 0
        self.tier = tier if enable_prefix_caching else None
        self.write_through = write_through and self.tier is not None
        self.tier_hits = 0  # tokens loaded from the tier instead of recomputed
        self.blocks_saved = 0
        self.block_bytes = block_bytes  # one block's K/V, all layers: for the bytes-moved count
        # Filled while serving one step, handed out with its result.
        self._tier_loads: dict[str, list[BlockTransfer]] = {}
        self._filled: list[BlockTransfer] = []
        # The offload tier's answers during the last step (replaying a journal gives them back instead of
        # asking again, so that the replay is exact).
        self.tier_answers: list[int] = []
        self._replayed_answers: list[int] | None = None
        # After a restore: the last two step ids the state saw. The scheduler's next call must have
        # received one of their answers, or the state missed steps and cannot be trusted.
        self._restored_step_ids: tuple[int | None, int | None] | None = None

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        state = self.requests.get(request_id)
        return [block.block_id for block in state.blocks] if state is not None else []

    def slot_usage(self) -> tuple[int, int]:
        """(slots holding computed or scheduled tokens, slots allocated) over every request."""
        used = sum(state.num_tokens for state in self.requests.values())
        allocated = sum(len(state.blocks) for state in self.requests.values()) * self.block_size
        return used, allocated

    def free(self, request_id: str) -> None:
        """Returns the request's blocks and forgets it; an unknown id is ignored, since an abort can race
        the request's finish or preemption."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            # Reversed, so that the pool evicts the request's tail before its (more shareable) prefix.
            self.block_pool.free_blocks(reversed(state.blocks))

    def step(self, step_request: BlockStepRequest, tier_answers: list[int] | None = None) -> BlockStepResult:
        """Serves one step. tier_answers: the offload tier's answers this step got when it first ran (a
        replay); None asks the tier."""
        self.tier_answers, self._replayed_answers = [], list(tier_answers) if tier_answers is not None else None
        self._check_restored(step_request.planned_step_id)
        self._follow_instances(step_request.scheduler_id, step_request.executor_epoch)
        self._acknowledge(step_request.planned_step_id)
        self._confirm_executed(step_request.executed_step_ids, set(step_request.failed_request_ids))
        self._previous_step_id, self._last_step_id = self._last_step_id, step_request.step_id
        self._unconfirmed[step_request.step_id] = []
        for request_id in step_request.free_request_ids:
            self.free(request_id)
        result = BlockStepResult()
        running = list(step_request.running)
        index = 0
        while index < len(running):
            request = running[index]
            if request.request_id not in self.requests:
                # Its blocks are gone (this manager restarted): recomputing it is the only safe answer.
                self._preempt(running.pop(index).request_id, result)
                continue
            new_block_ids = self._grow(request)
            if new_block_ids is not None:
                result.new_block_ids[request.request_id] = new_block_ids
                index += 1
            else:  # the tail gives its blocks back; it may be this very request
                self._preempt(running.pop().request_id, result)
        if not result.preempted_request_ids:
            for request in step_request.waiting:
                admitted = self._admit(request)
                if admitted is None:
                    break
                result.new_block_ids[request.request_id], result.num_cached_tokens[request.request_id] = admitted
        self._collect_transfers(result)
        return result

    def _check_restored(self, planned_step_id: int) -> None:
        if self._restored_step_ids is None:
            return
        if planned_step_id not in self._restored_step_ids:
            self._drop_requests()  # the restored state missed steps: recompute rather than trust it
        self._restored_step_ids = None

    def _drop_requests(self) -> None:
        self._unconfirmed, self._served_last = {}, []
        for request_id in list(self.requests):
            self.free(request_id)

    def _follow_instances(self, scheduler_id: str, executor_epoch: str) -> None:
        if self.executor_epoch is not None and executor_epoch != self.executor_epoch:
            # The KV behind every block died with the old executor: nothing in the pool may be served again.
            self._drop_requests()
            self.block_pool.forget_cached_blocks()
            if self.tier is not None:
                self.tier.executor_replaced()
        elif self.scheduler_id is not None and scheduler_id != self.scheduler_id:
            # A new scheduler re-submits what it serves; the old one's tables would only leak.
            self._drop_requests()
        self.scheduler_id, self.executor_epoch = scheduler_id, executor_epoch

    def _acknowledge(self, planned_step_id: int) -> None:
        served, self._served_last = self._served_last, []
        if planned_step_id == self._last_step_id:
            for state in served:
                state.num_blocks_sent = len(state.blocks)

    def _confirm_executed(self, executed_step_ids: list[int], failed: set[str]) -> None:
        """Indexes the blocks named by the calls whose steps ran; the names given by a call up to the last of
        those whose step did not run (or by a request whose part failed) are given up."""
        if not executed_step_ids:
            return
        executed, last = set(executed_step_ids), max(executed_step_ids)
        for step_id in sorted(s for s in self._unconfirmed if s <= last):
            ran = step_id in executed
            for request_id, state, index, block_hash_, naming_round in self._unconfirmed.pop(step_id):
                if self.requests.get(request_id) is not state or naming_round != state.naming_round:
                    continue  # gone, or named again since
                if not ran or request_id in failed:  # the block holds nothing known
                    state.num_named, state.last_name = len(state.block_hashes), None
                    state.naming_round += 1
                    continue
                state.block_hashes.append(block_hash_)
                block = state.blocks[index]
                if block.block_hash is None:
                    self.block_pool.cache_full_block(block, block_hash_)

    def _preempt(self, request_id: str, result: BlockStepResult) -> None:
        self.free(request_id)
        self.num_preemptions += 1
        result.preempted_request_ids.append(request_id)

    def _grow(self, request: BlockRequest) -> list[int] | None:
        """Grows a running request's table to request.num_tokens slots, all-or-nothing; its new block
        ids (with any the scheduler may not have received), or None (and nothing changed) when the pool is
        short."""
        state = self.requests[request.request_id]
        num_needed = -(-request.num_tokens // self.block_size) - len(state.blocks)
        if num_needed > 0:  # (most steps, a decode needs none)
            if num_needed > self.num_free_blocks:
                return None
            state.blocks.extend(self.block_pool.get_new_blocks(num_needed))
        if request.num_tokens > state.num_tokens:
            state.num_tokens = request.num_tokens
        if request.new_token_ids:
            state.token_ids[request.new_tokens_start:] = request.new_token_ids
        self._note_full_blocks(request.request_id, state)
        self._served_last.append(state)
        if state.num_blocks_sent == len(state.blocks):
            return []
        return [block.block_id for block in state.blocks[state.num_blocks_sent:]]

    def _admit(self, request: BlockRequest) -> tuple[list[int], int] | None:
        """Admits a waiting request from the longest cached prefix of its tokens: its whole block table and
        the number of leading tokens already computed, or None (and nothing changed) when the pool is short."""
        request_id, tokens, bs = request.request_id, list(request.prompt_token_ids), self.block_size
        self.free(request_id)  # a re-admission starts over
        hits, hashes, num_tier = self._cached_prefix(tokens, request.cache_salt)
        num_cached = (len(hits) + num_tier) * bs
        # num_tokens counts from the end of the cached prefix, up to the known tokens.
        end = min(num_cached + request.num_tokens, len(tokens))
        num_new = -(-end // bs) - len(hits)
        # A hit nobody holds sits in the free queue: taking it leaves one block fewer to allocate.
        if num_new > self.num_free_blocks - sum(1 for block in hits if block.ref_cnt == 0):
            return None
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        state = RequestBlocks(hits + new_blocks, end, tokens, request.cache_salt)
        state.block_hashes = hashes[: len(hits)]
        state.num_named = len(hits)
        self.requests[request_id] = state
        self.prefix_queries += len(tokens)
        self.prefix_hits += num_cached
        if num_tier:
            # The first fresh blocks take the tier's copies; they are indexed as full blocks below.
            tier_hashes = hashes[len(hits) : len(hits) + num_tier]
            self._tier_loads[request_id] = [
                BlockTransfer(block.block_id, block_hash) for block, block_hash in zip(new_blocks, tier_hashes)
            ]
            self.tier_hits += num_tier * bs
        self._note_full_blocks(request_id, state, num_from_tier=num_tier)
        self._served_last.append(state)
        return [block.block_id for block in state.blocks], num_cached

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
        if self._replayed_answers is not None:
            num_tier = self._replayed_answers.pop(0)
        else:
            num_tier = self.tier.leading_count(hashes[len(hits) :])
        self.tier_answers.append(num_tier)
        return hits, hashes[: len(hits) + num_tier], num_tier

    def _note_full_blocks(self, request_id: str, state: RequestBlocks, num_from_tier: int = 0) -> None:
        """Names the request's blocks that the served step fills completely with known tokens (and that no
        call still waiting names already), to be indexed once the step has run; the first num_from_tier of
        them are loaded from the tier, which has them."""
        if not self.enable_prefix_caching:
            return
        hashes, blocks, tokens, bs = state.block_hashes, state.blocks, state.token_ids, self.block_size
        num_full = min(state.num_tokens, len(tokens)) // bs
        start = state.num_named
        if num_full <= start:
            return
        parent = state.last_name if start > len(hashes) else hashes[-1] if hashes else self.root_hash
        named = self._unconfirmed[self._last_step_id]
        for i in range(start, num_full):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], state.cache_salt if i == 0 else None)
            named.append((request_id, state, i, parent, state.naming_round))
            if i >= len(hashes) + num_from_tier and self.block_pool.get_cached_block(parent) is None:
                self._filled.append(BlockTransfer(blocks[i].block_id, parent))
        state.num_named, state.last_name = num_full, parent

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

    # ------------------------------------------------------------------ durable state

    def export_state(self) -> dict:
        """Everything a restarted manager needs to go on where this one is (between two steps), as JSON."""
        pool = self.block_pool
        return {
            "pool": [self.num_blocks, self.block_size, self.root_hash.hex()],
            "instances": [self.scheduler_id, self.executor_epoch, self._previous_step_id, self._last_step_id],
            "free_queue": [block.block_id for block in pool.free_block_queue],
            "cached": {str(block.block_id): block_hash_.hex() for block_hash_, block in pool.cached_blocks.items()},
            "requests": {
                request_id: [[b.block_id for b in s.blocks], s.num_tokens, s.token_ids,
                             [h.hex() for h in s.block_hashes], s.cache_salt, s.num_blocks_sent,
                             [s.num_named, s.last_name.hex() if s.last_name else None, s.naming_round]]
                for request_id, s in self.requests.items()
            },
            "unconfirmed": [[step_id, request_id, index, h.hex(), naming_round]  # (those of gone requests are void)
                            for step_id, named in self._unconfirmed.items()
                            for request_id, state, index, h, naming_round in named
                            if self.requests.get(request_id) is state],
            "served_last": [request_id for request_id, s in self.requests.items() if s in self._served_last],
            "counters": [self.prefix_queries, self.prefix_hits, self.num_preemptions, self.tier_hits,
                         self.blocks_saved, pool.num_evictions],
        }

    def import_state(self, state: dict) -> None:
        """Takes over an exported state; ValueError (and nothing changed) if it is another pool's."""
        if state["pool"] != [self.num_blocks, self.block_size, self.root_hash.hex()]:
            raise ValueError("the saved state belongs to another pool (size, block size or model)")
        pool = BlockPool(self.num_blocks)
        requests: dict[str, RequestBlocks] = {}
        for request_id, (block_ids, num_tokens, token_ids, hashes, salt, num_sent, naming) in state["requests"].items():
            blocks = [pool.blocks[i] for i in block_ids]
            for block in blocks:
                block.ref_cnt += 1
            request = requests[request_id] = RequestBlocks(blocks, num_tokens, token_ids, salt)
            request.block_hashes = [bytes.fromhex(h) for h in hashes]
            request.num_blocks_sent = num_sent
            request.num_named, last_name, request.naming_round = naming
            request.last_name = bytes.fromhex(last_name) if last_name else None
        for block_id, block_hash_ in state["cached"].items():
            block = pool.blocks[int(block_id)]
            block.block_hash = bytes.fromhex(block_hash_)
            pool.cached_blocks[block.block_hash] = block
        pool.free_block_queue = FreeBlockQueue(pool.blocks[i] for i in state["free_queue"])
        pool._num_cached_evictable = sum(1 for b in pool.free_block_queue if b.block_hash is not None)
        (self.prefix_queries, self.prefix_hits, self.num_preemptions, self.tier_hits, self.blocks_saved,
         pool.num_evictions) = state["counters"]
        self.block_pool, self.requests = pool, requests
        self.scheduler_id, self.executor_epoch, self._previous_step_id, self._last_step_id = state["instances"]
        self._unconfirmed = {}
        for step_id, r, i, h, naming_round in state["unconfirmed"]:
            self._unconfirmed.setdefault(step_id, []).append((r, requests[r], i, bytes.fromhex(h), naming_round))
        self._served_last = [requests[r] for r in state["served_last"]]

    def restored(self) -> None:
        """Marks the state as restored: the next call must come from a scheduler that received the answer
        to one of the last two steps it saw."""
        self._restored_step_ids = (self._previous_step_id, self._last_step_id)

    def stats(self) -> dict[str, int | float]:
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_in_use": self.block_pool.num_in_use,
            "num_cached_evictable": self.block_pool.num_cached_evictable,
            "num_requests": self.num_requests,
            "usage": self.usage,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "evictions": self.block_pool.num_evictions,
            "tier_hits": self.tier_hits,
            "blocks_saved": self.blocks_saved,
            "bytes_moved": (self.blocks_saved + self.tier_hits // self.block_size) * self.block_bytes,
            **(self.tier.stats() if self.tier is not None else {"tier_index_blocks": 0, "tier_errors": 0}),
        }
