"""Prefix caching: the block manager's index under random traffic, and the engine reusing prefixes."""
from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcache_svc.block_hash import block_hash, root_hash
from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve import LLM, SamplingParams
from pagedserve.step import BlockRequest, BlockStepRequest

BLOCK_SIZE = 4


def test_hashes_are_stable_and_separate_salts_and_models():
    root = root_hash("m")
    assert root == root_hash("m") and root != root_hash("other")
    h = block_hash(root, [1, 2, 3, 4])
    assert h == block_hash(root_hash("m"), [1, 2, 3, 4])  # same bytes in any process
    assert h.hex() == block_hash(root, (1, 2, 3, 4)).hex()
    assert h != block_hash(root, [1, 2, 3, 4], salt="tenant-a")
    assert block_hash(root, [1, 2, 3, 4], salt="a") != block_hash(root, [1, 2, 3, 4], salt="b")
    assert block_hash(h, [5, 6, 7, 8]) != block_hash(root, [5, 6, 7, 8])  # the chain matters


class PrefixCacheMachine(RuleBasedStateMachine):
    """Admits, grows and finishes requests drawn from a few shared prefixes in a small pool, writing each
    computed token into a model of the KV blocks, and checks the index never lies. Each call says that the
    step of the call `lag` calls before it ran (2: steps planned ahead)."""

    lag = 1

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, model_id="test")
        self.num_calls = 0
        self.content: dict[int, list[int | None]] = {}  # block id -> token at each offset, as "computed"
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0
        self.prefixes = [random.Random(i).choices(range(50), k=12) for i in range(3)]

    def _write(self, request_id: str, start: int, end: int) -> None:
        table = self.manager.block_ids(request_id)
        for position in range(start, end):
            block = table[position // BLOCK_SIZE]
            # A block written now must be this request's alone (in use by nobody else).
            assert self.manager.block_pool.blocks[block].ref_cnt == 1, "wrote into a shared block"
            self.content.setdefault(block, [None] * BLOCK_SIZE)[position % BLOCK_SIZE] = self.tokens[request_id][position]

    @rule(prefix=st.integers(0, 2), suffix=st.lists(st.integers(0, 49), max_size=6), salt=st.sampled_from([None, "s"]),
          chunk=st.integers(1, 20))
    def admit(self, prefix, suffix, salt, chunk):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        tokens = self.prefixes[prefix][: 4 + len(suffix)] + suffix
        result = self.call(BlockStepRequest(waiting=[
            BlockRequest(request_id, chunk, prompt_token_ids=tokens, cache_salt=salt)
        ]))
        if request_id not in result.new_block_ids:
            assert self.manager.block_ids(request_id) == []
            return
        cached = result.num_cached_tokens[request_id]
        assert cached % BLOCK_SIZE == 0 and cached < len(tokens)
        # Every cached block holds exactly the prompt's tokens at those positions.
        table = self.manager.block_ids(request_id)
        for position in range(cached):
            assert self.content[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] == tokens[position]
        self.tokens[request_id] = tokens
        end = min(cached + chunk, len(tokens))
        self._write(request_id, cached, end)
        self.computed[request_id] = end

    @rule(data=st.data())
    def grow(self, data):
        if not self.computed:
            return
        request_id = data.draw(st.sampled_from(sorted(self.computed)))
        tokens = self.tokens[request_id]
        start = self.computed[request_id]
        new_tokens = []
        if start == len(tokens):  # decoding: a new token appears
            new_tokens = [data.draw(st.integers(0, 49))]
            tokens.extend(new_tokens)
        end = min(start + data.draw(st.integers(1, 6)), len(tokens))
        result = self.call(BlockStepRequest(running=[
            BlockRequest(request_id, end, new_token_ids=new_tokens or None, new_tokens_start=len(tokens) - len(new_tokens))
        ]))
        if result.preempted_request_ids == [request_id]:
            assert self.manager.block_ids(request_id) == []
            del self.computed[request_id], self.tokens[request_id]
            return
        self._write(request_id, start, end)
        self.computed[request_id] = end

    def call(self, request: BlockStepRequest):
        """The manager's step, numbered; the step `lag` calls back ran (the test computes each at once)."""
        self.num_calls += 1
        request.step_id = self.num_calls
        request.planned_step_id = self.num_calls - 1
        request.executed_step_ids = [self.num_calls - self.lag] if self.num_calls > self.lag else []
        return self.manager.step(request)

    def finish_request(self, request_id: str) -> None:
        self.call(BlockStepRequest(free_request_ids=[request_id]))
        del self.computed[request_id], self.tokens[request_id]

    @rule(data=st.data())
    def finish(self, data):
        if self.computed:
            self.finish_request(data.draw(st.sampled_from(sorted(self.computed))))

    @invariant()
    def index_is_truthful(self):
        pool = self.manager.block_pool
        assert pool.num_free_blocks + pool.num_in_use == pool.num_blocks
        for block_hash_, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash_
            assert None not in self.content[block.block_id], "a cached block must be fully computed"
        # Blocks of live requests are referenced, so none of them can be evicted.
        for request_id in self.computed:
            for block_id in self.manager.block_ids(request_id):
                assert pool.blocks[block_id].ref_cnt > 0


PrefixCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


class PrefixCacheMachinePlannedAhead(PrefixCacheMachine):
    lag = 2


PrefixCacheMachinePlannedAhead.TestCase.settings = PrefixCacheMachine.TestCase.settings
TestPrefixCacheMachinePlannedAhead = PrefixCacheMachinePlannedAhead.TestCase


def test_the_machine_does_index_blocks():
    """The machines above are only meaningful if blocks get indexed: one fixed run shows they do."""
    for machine_class in (PrefixCacheMachine, PrefixCacheMachinePlannedAhead):
        machine = machine_class()
        machine.admit(prefix=0, suffix=[1, 2, 3], salt=None, chunk=20)
        for _ in range(machine.lag + 1):
            machine.call(BlockStepRequest())
        assert len(machine.manager.block_pool.cached_blocks) == 2  # the full blocks of the 10-token prompt
        machine.index_is_truthful()


# ----------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=4 << 20, block_size=BLOCK_SIZE * 4)


# Both dtypes, whatever `auto` picks on this CPU: the CPU kernels serve the warm run's suffix as few query rows
# and the cold run's whole prompt as many, two code paths whose bfloat16 arithmetic must agree as closely as
# their float32 (a softmax weight rounded to bfloat16 on one path only moved these logprobs by 2e-3).
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_warm_request_prefills_only_what_is_not_cached_and_matches_a_cold_run(tiny_llama_dir, dtype):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype=dtype, kv_cache_memory=4 << 20, block_size=BLOCK_SIZE * 4)
    rng = random.Random(5)
    shared = [rng.randrange(1, 150) for _ in range(48)]  # 3 blocks of 16
    first = shared + [rng.randrange(1, 150) for _ in range(10)]
    second = shared + [rng.randrange(1, 150) for _ in range(7)]
    # Logprobs make the comparison sensitive: a tiny random model's greedy tokens barely depend on context.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    llm.generate([first], params)
    before = llm.runner.num_prefill_tokens + llm.runner.num_decode_tokens
    [warm] = llm.generate([second], params)
    computed = llm.runner.num_prefill_tokens + llm.runner.num_decode_tokens - before
    # 7 suffix tokens prefilled, then 7 decode steps (the 8th token needs no forward pass).
    assert computed == 7 + 7
    assert llm.block_manager.prefix_hits >= 48

    cold_llm = LLM(str(tiny_llama_dir), device="cpu", dtype=dtype, kv_cache_memory=4 << 20, block_size=16,
                   enable_prefix_caching=False)
    [cold] = cold_llm.generate([second], params)
    assert warm.token_ids == cold.token_ids
    assert [e.logprob for e in warm.logprobs] == pytest.approx([e.logprob for e in cold.logprobs], abs=1e-5)


def test_different_salts_share_nothing(llm):
    prompt = random.Random(6).choices(range(1, 150), k=40)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    [a] = llm.generate([prompt], params, cache_salt="tenant-a")
    hits = llm.block_manager.prefix_hits
    [b] = llm.generate([prompt], params, cache_salt="tenant-b")
    assert llm.block_manager.prefix_hits == hits
    [a_again] = llm.generate([prompt], params, cache_salt="tenant-a")
    assert llm.block_manager.prefix_hits == hits + 32
    assert a.token_ids == b.token_ids == a_again.token_ids
