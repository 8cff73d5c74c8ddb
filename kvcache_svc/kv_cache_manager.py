"""The request-level API on top of the block pool, and the one authority on block arithmetic.

The scheduler calls ``step`` once per engine step with every free and its candidates in priority order:
the running requests (highest priority first) with the slots each needs by the end of the step, then the
waiting requests it would like to admit. The manager serves the running ones in order; when the pool
cannot give one its blocks, the lowest-priority running candidate (the tail) gives all of its blocks back
and is reported preempted, until the request fits or is itself the one preempted. So preemption is
last-in-first-out by construction and the scheduler never predicts a block count. Waiting requests are
admitted in order, only if nobody was preempted this step, up to the first that does not fit.

Slots reserved ahead (``lookahead_slots``, asked for by a scheduler whose own work limits the steps): once
every need and admission of the step is met and nobody was preempted, each running request, in order, gets
the blocks for that many slots past what it needs, while a quarter of the pool stays free. Each answer says
how many slots the table of every request it gave blocks holds (``num_slots``), and the scheduler plans the
steps that need no more, admit nobody and free nothing without calling. Those steps' tokens reach this
manager with the next call, which names and indexes their blocks as it does any call's.

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

Preemption by swap: a preempted request's blocks that hold computed K/V (every full one, and its last,
partial one) can instead be copied to the executor's swap space in host memory before the step reuses them
(``swap_out``), and loaded back into fresh blocks when it is re-admitted, after whatever prefix the pool
still holds. A copy is named by its content hash, the prefix hash of a full block and, for the partial
block, the same chain over its fewer tokens, so a load can only ever fill a block with the K/V of exactly
those tokens; and only the request it was saved for loads it. Which preemptions swap: ``preemption_mode``,
where ``auto`` compares the executor's measured costs (recompute: tokens / prefill tokens per second;
swap: 2 x blocks x block bytes / host copy bytes per second, out and back), and never beyond the swap
space's capacity, which this manager counts in blocks. A swap counts only once the step that carries its
copies is known to have run; copies are released (``swap_free``, applied after the step's loads) when the
request is re-admitted, ends, or its swap did not happen, and a release that may not have reached the
executor is sent again. Only K/V a step known to have run computed is ever copied.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvcache_svc.block_hash import block_hash, root_hash
from kvcache_svc.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvcache_svc.offload_index import LocalTierIndex
from pagedserve.step import BlockRequest, BlockStepRequest, BlockStepResult, BlockTransfer


class RequestBlocks:
    """One request as the manager knows it: its block table and what prefix caching needs to name it."""

    __slots__ = ("blocks", "num_tokens", "token_ids", "block_hashes", "cache_salt", "num_blocks_sent", "num_named",
                 "last_name", "naming_round", "num_computed")

    def __init__(self, blocks: list[KVBlock], num_tokens: int, token_ids: list[int], cache_salt: str | None):
        self.blocks = blocks
        self.num_tokens = num_tokens  # slots in use once the step served last has run
        self.num_computed = 0  # slots whose K/V a step known to have run computed (or loaded)
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


class SwappedRequest:
    """A request preempted by swap: the content hashes of its copies in the swap space, in block order (the
    last one partial when num_tokens is not a whole number of blocks), and the tokens they hold."""

    __slots__ = ("block_hashes", "num_tokens")

    def __init__(self, block_hashes: list[bytes], num_tokens: int) -> None:
        self.block_hashes = block_hashes
        self.num_tokens = num_tokens


@dataclass(slots=True)
class CachedPrefix:
    """What an admitted request finds already computed, in this order: full blocks in the pool, full blocks
    to load from its own swapped copies, then from the offload tier, then its swapped partial block."""

    hits: list[KVBlock] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of the hits and of the full blocks to load
    num_swapped: int = 0
    num_tier: int = 0
    partial: tuple[bytes, int] | None = None  # (hash, tokens it holds)

    @property
    def num_loads(self) -> int:
        return self.num_swapped + self.num_tier


PREEMPTION_MODES = ("recompute", "swap", "auto")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 model_id: str = "", tier: LocalTierIndex | None = None, write_through: bool = False,
                 block_bytes: int = 0, preemption_mode: str = "auto", swap_capacity_blocks: int = 0,
                 prefill_tokens_per_s: float = 0.0, copy_bytes_per_s: float = 0.0) -> None:
        """swap_capacity_blocks: what the executor's swap space holds (0: no swap); prefill_tokens_per_s and
        copy_bytes_per_s: the executor's measured costs, which preemption_mode "auto" compares (unknown, 0:
        recompute)."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {preemption_mode!r}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.requests: dict[str, RequestBlocks] = {}
        # The scheduler and executor instances the pool's state belongs to (None until the first step).
        self.scheduler_id: str | None = None
        self.executor_epoch: str | None = None
        # Per call whose step is not known to have run yet (by step id): the full blocks it named, indexed
        # once it has: (request id, its state, block index in its table, hash, the state's naming round).
        self._unconfirmed: dict[int, list[tuple[str, RequestBlocks, int, bytes, int]]] = {}
        # Per such call: the requests it served, computed up to the slots it gave them once its step has run:
        # (request id, its state, its num_tokens after the call).
        self._computing: dict[int, list[tuple[str, RequestBlocks, int]]] = {}
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
        # Preemption by swap.
        self.preemption_mode = preemption_mode
        self.swap_capacity_blocks = swap_capacity_blocks
        self.prefill_tokens_per_s, self.copy_bytes_per_s = prefill_tokens_per_s, copy_bytes_per_s
        self.swapped: dict[str, SwappedRequest] = {}
        self._swap_refs: dict[bytes, int] = {}  # per copy in the swap space: the swapped requests holding it
        # Filled while serving one step: copies to make, and released copies (an ordered set) to free.
        self._swap_out: list[BlockTransfer] = []
        self._swap_frees: dict[bytes, None] = {}
        # Per call whose step is not known to have run yet: the swaps it ordered, which count once its step
        # has run, and the frees it sent, which are sent again if not.
        self._unconfirmed_swaps: dict[int, list[tuple[str, SwappedRequest]]] = {}
        self._frees_sent: dict[int, list[bytes]] = {}
        self.num_swaps = self.blocks_swapped_out = self.blocks_swapped_in = 0

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
        """Returns the request's blocks and its swapped copies, and forgets it; an unknown id is ignored,
        since an abort can race the request's finish or preemption."""
        self._free_blocks(request_id)
        self._release_swap(request_id)

    def _free_blocks(self, request_id: str) -> None:
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
        for pending in (self._unconfirmed, self._computing, self._unconfirmed_swaps):
            pending[step_request.step_id] = []
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
            if step_request.lookahead_slots:
                self._reserve_ahead(running, step_request.lookahead_slots, result)
        bs = self.block_size
        result.num_slots = {request_id: len(self.requests[request_id].blocks) * bs
                            for request_id, block_ids in result.new_block_ids.items() if block_ids}
        self._collect_transfers(result)
        return result

    def _reserve_ahead(self, running: list[BlockRequest], lookahead_slots: int, result: BlockStepResult) -> None:
        """Gives the running requests, in order, the blocks for lookahead_slots more slots than they need, while
        a quarter of the pool stays free: only once every request's and every admission's needs are met, so
        that no reservation ever makes another request wait or be preempted."""
        spare = self.num_free_blocks - self.num_blocks // 4
        for request in running:
            state = self.requests[request.request_id]
            num_ahead = -(-(request.num_tokens + lookahead_slots) // self.block_size) - len(state.blocks)
            if num_ahead <= 0:
                continue
            if num_ahead > spare:
                return
            spare -= num_ahead
            state.blocks.extend(self.block_pool.get_new_blocks(num_ahead))
            unsent = state.blocks[state.num_blocks_sent:]
            result.new_block_ids[request.request_id] = [block.block_id for block in unsent]

    def _check_restored(self, planned_step_id: int) -> None:
        if self._restored_step_ids is None:
            return
        if planned_step_id not in self._restored_step_ids:
            self._drop_requests()  # the restored state missed steps: recompute rather than trust it
        self._restored_step_ids = None

    def _drop_requests(self) -> None:
        self._unconfirmed, self._served_last, self._computing = {}, [], {}
        for request_id in [*self.requests, *self.swapped]:
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
        """Settles the calls up to the last one whose step ran: a call whose step ran has its named blocks
        indexed, its requests' slots computed and its swaps counted; one whose step did not run (or a request
        whose part failed) has its names given up, its swap copies dropped (they may not exist: those
        requests are recomputed) and its frees sent again (they may not have happened)."""
        if not executed_step_ids:
            return
        executed, last = set(executed_step_ids), max(executed_step_ids)
        settled = {s for s in (*self._unconfirmed, *self._computing, *self._unconfirmed_swaps, *self._frees_sent)
                   if s <= last}
        for step_id in sorted(settled):
            ran = step_id in executed
            for request_id, state, num_tokens in self._computing.pop(step_id, ()):
                if ran and request_id not in failed and self.requests.get(request_id) is state:
                    state.num_computed = max(state.num_computed, num_tokens)
            for request_id, record in self._unconfirmed_swaps.pop(step_id, ()):
                if not ran and self.swapped.get(request_id) is record:
                    self._release_swap(request_id)
            for block_hash_ in self._frees_sent.pop(step_id, ()):
                if not ran and block_hash_ not in self._swap_refs:
                    self._swap_frees[block_hash_] = None
            for request_id, state, index, block_hash_, naming_round in self._unconfirmed.pop(step_id, ()):
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
        state = self.requests.get(request_id)
        if state is not None:
            self._swap_out_blocks(request_id, state)
        self._free_blocks(request_id)
        self.num_preemptions += 1
        result.preempted_request_ids.append(request_id)

    def _swap_out_blocks(self, request_id: str, state: RequestBlocks) -> None:
        """Orders the copies of the request's computed blocks to the swap space, if the preemption mode, the
        space left and (auto) the estimated costs say so; otherwise it will be recomputed."""
        num_tokens = min(state.num_computed, len(state.token_ids))
        if self.preemption_mode == "recompute" or num_tokens == 0:
            return
        hashes = self._computed_block_hashes(state, num_tokens)
        new = [i for i, block_hash_ in enumerate(hashes) if block_hash_ not in self._swap_refs]
        # Copies being freed this step still take room until the executor has freed them.
        if len(self._swap_refs) + len(self._swap_frees) + len(new) > self.swap_capacity_blocks:
            return
        if self.preemption_mode == "auto" and not self._swap_is_cheaper(num_tokens, len(hashes)):
            return
        for i in new:
            self._swap_out.append(BlockTransfer(state.blocks[i].block_id, hashes[i]))
            self._swap_frees.pop(hashes[i], None)  # released earlier this step: it is needed again
        for block_hash_ in hashes:
            self._swap_refs[block_hash_] = self._swap_refs.get(block_hash_, 0) + 1
        record = self.swapped[request_id] = SwappedRequest(hashes, num_tokens)
        self._unconfirmed_swaps[self._last_step_id].append((request_id, record))
        self.num_swaps += 1
        self.blocks_swapped_out += len(new)

    def _swap_is_cheaper(self, num_tokens: int, num_blocks: int) -> bool:
        """The estimate of preemption_mode "auto": copying the blocks out and back in against computing the
        tokens again (the executor's measured speeds; unknown ones mean recompute)."""
        if self.prefill_tokens_per_s <= 0 or self.copy_bytes_per_s <= 0:
            return False
        recompute_s = num_tokens / self.prefill_tokens_per_s
        swap_s = 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s
        return swap_s < recompute_s

    def _computed_block_hashes(self, state: RequestBlocks, num_tokens: int) -> list[bytes]:
        """The content hashes of the blocks holding the request's first num_tokens: the prefix cache's chain
        over the full blocks, continued over the partial last one (whose fewer tokens give a hash that no
        full block has)."""
        bs = self.block_size
        hashes = state.block_hashes[: num_tokens // bs]
        parent = hashes[-1] if hashes else self.root_hash
        for i in range(len(hashes), -(-num_tokens // bs)):
            tokens = state.token_ids[i * bs : min((i + 1) * bs, num_tokens)]
            parent = block_hash(parent, tokens, state.cache_salt if i == 0 else None)
            hashes.append(parent)
        return hashes

    def _release_swap(self, request_id: str) -> None:
        """Drops the request's claim on its swapped copies; those nobody else holds are freed with the step."""
        record = self.swapped.pop(request_id, None)
        if record is None:
            return
        for block_hash_ in record.block_hashes:
            self._swap_refs[block_hash_] -= 1
            if not self._swap_refs[block_hash_]:
                del self._swap_refs[block_hash_]
                self._swap_frees[block_hash_] = None

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
        if min(state.num_tokens, len(state.token_ids)) // self.block_size > state.num_named:  # a block filled
            self._note_full_blocks(request.request_id, state)
        self._computing[self._last_step_id].append((request.request_id, state, state.num_tokens))
        self._served_last.append(state)
        if state.num_blocks_sent == len(state.blocks):
            return []
        return [block.block_id for block in state.blocks[state.num_blocks_sent:]]

    def _admit(self, request: BlockRequest) -> tuple[list[int], int] | None:
        """Admits a waiting request from the longest cached prefix of its tokens: its whole block table and
        the number of leading tokens already computed, or None (and nothing changed) when the pool is short."""
        request_id, tokens, bs = request.request_id, list(request.prompt_token_ids), self.block_size
        self._free_blocks(request_id)  # a re-admission starts over (from its swapped copies, if any)
        prefix = self._cached_prefix(request_id, tokens, request.cache_salt)
        hits, num_loads = prefix.hits, prefix.num_loads
        num_cached = (len(hits) + num_loads) * bs + (prefix.partial[1] if prefix.partial else 0)
        # num_tokens counts from the end of the cached prefix, up to the known tokens.
        end = min(num_cached + request.num_tokens, len(tokens))
        num_new = -(-end // bs) - len(hits)
        # A hit nobody holds sits in the free queue: taking it leaves one block fewer to allocate.
        if num_new > self.num_free_blocks - sum(1 for block in hits if block.ref_cnt == 0):
            return None
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        state = RequestBlocks(hits + new_blocks, end, tokens, request.cache_salt)
        state.block_hashes = prefix.hashes[: len(hits)]
        state.num_named = len(hits)
        state.num_computed = len(hits) * bs
        self.requests[request_id] = state
        self.prefix_queries += len(tokens)
        self.prefix_hits += num_cached
        # The first fresh blocks take the copies from host memory; the full ones are indexed as full blocks
        # below, and the partial one fills up as the request computes on.
        loads = [BlockTransfer(block.block_id, block_hash_)
                 for block, block_hash_ in zip(new_blocks, prefix.hashes[len(hits):])]
        if prefix.partial is not None:
            loads.append(BlockTransfer(new_blocks[num_loads].block_id, *prefix.partial))
        if loads:
            self._tier_loads[request_id] = loads
        self.tier_hits += prefix.num_tier * bs
        self.blocks_swapped_in += prefix.num_swapped + (prefix.partial is not None)
        self._release_swap(request_id)  # the executor frees the copies after this step's loads
        self._note_full_blocks(request_id, state, num_from_tier=num_loads)
        self._computing[self._last_step_id].append((request_id, state, state.num_tokens))
        self._served_last.append(state)
        return [block.block_id for block in state.blocks], num_cached

    def cached_prefix_tokens(self, request_id: str, tokens: list[int], salt: str | None) -> int:
        """Leading tokens of a waiting request that admitting it here would not compute (pool, its swapped
        copies, the tier); changes nothing but the tier's query counters."""
        self._replayed_answers = None
        prefix = self._cached_prefix(request_id, tokens, salt)
        self.tier_answers = []  # a question asked for routing, not part of any step a journal replays
        return (len(prefix.hits) + prefix.num_loads) * self.block_size + (prefix.partial[1] if prefix.partial else 0)

    def _cached_prefix(self, request_id: str, tokens: list[int], salt: str | None) -> CachedPrefix:
        """The longest run of leading full blocks already in the pool; after them, those of the request's own
        swapped copies, then those the tier holds; and its swapped partial block if the runs reach it."""
        prefix, swapped = CachedPrefix(), self.swapped.get(request_id)
        if not self.enable_prefix_caching and swapped is None:
            return prefix
        hashes, parent, bs = [], self.root_hash, self.block_size
        num_full = (len(tokens) - 1) // bs  # the last token is always computed
        for i in range(num_full):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], salt if i == 0 else None)
            hashes.append(parent)
        if self.enable_prefix_caching:
            for block_hash_ in hashes:
                block = self.block_pool.get_cached_block(block_hash_)
                if block is None:
                    break
                prefix.hits.append(block)
        found = len(prefix.hits)
        if swapped is not None:
            full = swapped.block_hashes[: swapped.num_tokens // bs]
            while found < min(len(full), num_full) and full[found] == hashes[found]:
                found += 1
            prefix.num_swapped = found - len(prefix.hits)
            if found == len(full) and swapped.num_tokens % bs and swapped.num_tokens < len(tokens):
                # Named by the tokens given now: a copy of other tokens cannot match.
                partial = block_hash(hashes[found - 1] if found else self.root_hash,
                                     tokens[found * bs : swapped.num_tokens], salt if found == 0 else None)
                if partial == swapped.block_hashes[-1]:
                    prefix.partial = (partial, swapped.num_tokens % bs)
        if self.tier is not None and prefix.partial is None and found < num_full:
            if self._replayed_answers is not None:
                prefix.num_tier = self._replayed_answers.pop(0)
            else:
                prefix.num_tier = self.tier.leading_count(hashes[found:])
            self.tier_answers.append(prefix.num_tier)
        prefix.hashes = hashes[: found + prefix.num_tier]
        return prefix

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
        result.swap_out, self._swap_out = self._swap_out, []
        result.swap_free, self._swap_frees = list(self._swap_frees), {}
        if result.swap_free:
            self._frees_sent[self._last_step_id] = result.swap_free
        if self.tier is None:
            return
        # A block with a copy in the swap space needs none in the tier: it comes back from there, and goes to
        # the tier if it is evicted again after that.
        result.saves_before = [BlockTransfer(block_id, block_hash) for block_id, block_hash in evicted
                               if block_hash not in self._swap_refs]
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
                             [h.hex() for h in s.block_hashes], s.cache_salt, s.num_blocks_sent, s.num_computed,
                             [s.num_named, s.last_name.hex() if s.last_name else None, s.naming_round]]
                for request_id, s in self.requests.items()
            },
            "unconfirmed": [[step_id, request_id, index, h.hex(), naming_round]  # (those of gone requests are void)
                            for step_id, named in self._unconfirmed.items()
                            for request_id, state, index, h, naming_round in named
                            if self.requests.get(request_id) is state],
            "served_last": [request_id for request_id, s in self.requests.items() if s in self._served_last],
            "computing": [[step_id, request_id, num_tokens] for step_id, served in self._computing.items()
                          for request_id, s, num_tokens in served if self.requests.get(request_id) is s],
            "swapped": {request_id: [[h.hex() for h in record.block_hashes], record.num_tokens]
                        for request_id, record in self.swapped.items()},
            "unconfirmed_swaps": [[step_id, request_id] for step_id, swaps in self._unconfirmed_swaps.items()
                                  for request_id, record in swaps if self.swapped.get(request_id) is record],
            "frees_sent": [[step_id, [h.hex() for h in frees]] for step_id, frees in self._frees_sent.items()],
            "counters": [self.prefix_queries, self.prefix_hits, self.num_preemptions, self.tier_hits,
                         self.blocks_saved, pool.num_evictions, self.num_swaps, self.blocks_swapped_out,
                         self.blocks_swapped_in],
        }

    def import_state(self, state: dict) -> None:
        """Takes over an exported state; ValueError (and nothing changed) if it is another pool's."""
        if state["pool"] != [self.num_blocks, self.block_size, self.root_hash.hex()]:
            raise ValueError("the saved state belongs to another pool (size, block size or model)")
        pool = BlockPool(self.num_blocks)
        requests: dict[str, RequestBlocks] = {}
        for request_id, (block_ids, num_tokens, token_ids, hashes, salt, num_sent, num_computed, naming) in \
                state["requests"].items():
            blocks = [pool.blocks[i] for i in block_ids]
            for block in blocks:
                block.ref_cnt += 1
            request = requests[request_id] = RequestBlocks(blocks, num_tokens, token_ids, salt)
            request.block_hashes = [bytes.fromhex(h) for h in hashes]
            request.num_blocks_sent = num_sent
            request.num_computed = num_computed
            request.num_named, last_name, request.naming_round = naming
            request.last_name = bytes.fromhex(last_name) if last_name else None
        swapped = {request_id: SwappedRequest([bytes.fromhex(h) for h in hashes], num_tokens)
                   for request_id, (hashes, num_tokens) in state["swapped"].items()}
        for block_id, block_hash_ in state["cached"].items():
            block = pool.blocks[int(block_id)]
            block.block_hash = bytes.fromhex(block_hash_)
            pool.cached_blocks[block.block_hash] = block
        pool.free_block_queue = FreeBlockQueue(pool.blocks[i] for i in state["free_queue"])
        pool._num_cached_evictable = sum(1 for b in pool.free_block_queue if b.block_hash is not None)
        (self.prefix_queries, self.prefix_hits, self.num_preemptions, self.tier_hits, self.blocks_saved,
         pool.num_evictions, self.num_swaps, self.blocks_swapped_out, self.blocks_swapped_in) = state["counters"]
        self.block_pool, self.requests, self.swapped = pool, requests, swapped
        self._swap_refs = {}
        for record in swapped.values():
            for block_hash_ in record.block_hashes:
                self._swap_refs[block_hash_] = self._swap_refs.get(block_hash_, 0) + 1
        self.scheduler_id, self.executor_epoch, self._previous_step_id, self._last_step_id = state["instances"]
        self._unconfirmed = {}
        for step_id, r, i, h, naming_round in state["unconfirmed"]:
            self._unconfirmed.setdefault(step_id, []).append((r, requests[r], i, bytes.fromhex(h), naming_round))
        self._served_last = [requests[r] for r in state["served_last"]]
        self._computing, self._unconfirmed_swaps = {}, {}
        for step_id, r, num_tokens in state["computing"]:
            self._computing.setdefault(step_id, []).append((r, requests[r], num_tokens))
        for step_id, r in state["unconfirmed_swaps"]:
            self._unconfirmed_swaps.setdefault(step_id, []).append((r, swapped[r]))
        self._frees_sent = {step_id: [bytes.fromhex(h) for h in frees] for step_id, frees in state["frees_sent"]}

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
            "num_swaps": self.num_swaps,
            "blocks_swapped_out": self.blocks_swapped_out,
            "blocks_swapped_in": self.blocks_swapped_in,
            "swap_blocks_in_use": len(self._swap_refs),
            **(self.tier.stats() if self.tier is not None else {"tier_index_blocks": 0, "tier_errors": 0}),
        }
