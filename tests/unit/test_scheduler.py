"""The scheduler against the real block manager and a fake executor that checks what it is fed.

The fake executor rebuilds every request's token sequence from the steps it receives (failing on a gap,
an overlap or a slot it was not given), and "samples" a token that is a hash of the whole sequence, so
any feeding mistake changes the output, the way a real model's would. Like the real one, it feeds the
token it sampled for a request into a row that asks for it (ExecuteRequest.feed_sampled), and refuses such
a row when it sampled nothing for that position, and a row of a request it holds no state for.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteResult, ExecuteStep, PromptLogprobs, SampledToken, one_executor
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler, SchedulerConfig

VOCAB = 1000
EOS = 999


class CheckingExecutor:
    """Stores each token id in its KV slot (a fake KV cache) and reads a request's whole sequence back
    through its block table, so a wrong table, a wrong slot or a wrongly shared prefix block changes the
    sequence and hence the "sampled" token."""

    def __init__(self, block_manager: KVCacheManager, block_size: int, eos_after: dict[str, int] | None = None):
        self.block_manager = block_manager
        self.block_size = block_size
        self.slots: dict[int, int] = {}
        self.progress: dict[str, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.eos_after = eos_after or {}
        self.steps: list[ExecuteStep] = []
        self.sampled: dict[str, tuple[int, int]] = {}  # request id -> (position of the token, token) sampled last

    def __call__(self, step: ExecuteStep) -> ExecuteResult:
        self.steps.append(step)
        for request_id in step.finished_request_ids:
            self.progress.pop(request_id, None)
            self.block_tables.pop(request_id, None)
            self.sampled.pop(request_id, None)
        result = ExecuteResult()
        for req in step.requests:
            tokens = list(req.token_ids)
            if req.feed_sampled:
                position, token = self.sampled.get(req.request_id, (None, None))
                if position != req.start_position + len(tokens):
                    result.rejected[req.request_id] = "no token was sampled for that position"
                    continue
                tokens.append(token)
            if req.sampling_params is not None:
                self.progress[req.request_id] = req.start_position  # a prefix hit starts past zero
                self.block_tables[req.request_id] = []
                self.sampled.pop(req.request_id, None)
            elif req.request_id not in self.progress:  # (a step after one that failed)
                result.rejected[req.request_id] = "unknown to the executor"
                continue
            assert req.start_position == self.progress[req.request_id], "tokens fed out of order"
            table = self.block_tables[req.request_id]
            table.extend(req.new_block_ids)
            # The executor's table must equal the block manager's (when the step runs as soon as it is planned)
            # and cover every position.
            if self.block_manager is not None:
                assert table == self.block_manager.block_ids(req.request_id)
            end = req.start_position + len(tokens)
            assert len(table) * self.block_size >= end
            for position, token in zip(range(req.start_position, end), tokens):
                self.slots[self.slot(table, position)] = token
            self.progress[req.request_id] = end
            if req.sample:
                sequence = [self.slots[self.slot(table, p)] for p in range(end)]
                token = self.next_token(req.request_id, sequence)
                result.sampled[req.request_id] = SampledToken(token)
                self.sampled[req.request_id] = (end, token)
        return result

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def next_token(self, request_id: str, sequence: list[int]) -> int:
        if request_id in self.eos_after and len(sequence) >= self.eos_after[request_id]:
            return EOS
        return hash((len(sequence), sum(sequence), sequence[-1])) % (VOCAB - 1)


def make_engine(num_blocks: int, block_size: int = 4, **config):
    block_manager = KVCacheManager(num_blocks, block_size)
    config.setdefault("max_model_len", 512)
    scheduler = Scheduler(SchedulerConfig(block_size=block_size, **config), one_executor(block_manager.step))
    return scheduler, block_manager, CheckingExecutor(block_manager, block_size)


def add(scheduler, request_id: str, prompt: list[int], **params) -> Request:
    request = Request(request_id, prompt, SamplingParams(**params), (EOS,), scheduler.config.max_model_len)
    scheduler.add_request(request)
    return request


def run_to_completion(scheduler, executor, block_manager, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        for output in scheduler.step(executor):
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        # The block manager holds exactly the running requests (and those ended in this step).
        assert {r.request_id for r in scheduler.running} <= set(block_manager.requests)
    assert not scheduler.has_unfinished_requests(), "requests still unfinished"
    return outputs


def random_prompts(count: int, seed: int, low: int = 5, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(low, high))] for _ in range(count)]


def test_quarter_pool_preempts_and_every_output_matches_an_unconstrained_run():
    prompts = random_prompts(32, seed=0)
    max_tokens = 32
    block_size = 4
    blocks_needed = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)

    results = {}
    for num_blocks in (blocks_needed, blocks_needed // 4):
        scheduler, block_manager, executor = make_engine(num_blocks, block_size, max_num_batched_tokens=64)
        for i, prompt in enumerate(prompts):
            add(scheduler, f"r{i}", prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True)
        results[num_blocks] = run_to_completion(scheduler, executor, block_manager)
        scheduler.step(executor)  # an empty step hands the last finished requests' blocks back
        assert block_manager.num_free_blocks == num_blocks and block_manager.num_requests == 0
        if num_blocks == blocks_needed:
            assert scheduler.num_preemptions == 0
        else:
            assert scheduler.num_preemptions > 0
    unconstrained, constrained = results[blocks_needed], results[blocks_needed // 4]
    assert len(constrained) == 32
    assert all(len(tokens) == max_tokens for tokens in constrained.values())
    assert constrained == unconstrained


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(1, 96),
    max_num_seqs=st.integers(1, 12),
    num_blocks=st.integers(40, 200),
)
def test_token_budget_and_max_num_seqs_are_never_exceeded(seed, budget, max_num_seqs, num_blocks):
    scheduler, block_manager, executor = make_engine(
        num_blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=160,
    )
    rng = random.Random(seed)
    for i, prompt in enumerate(random_prompts(rng.randint(1, 10), seed, high=100)):
        add(scheduler, f"r{i}", prompt, temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True)
    run_to_completion(scheduler, executor, block_manager)
    for step in executor.steps:
        assert sum(len(r.token_ids) for r in step.requests) <= budget
        assert len(step.requests) <= max_num_seqs


def test_long_prompt_is_chunked_and_decodes_share_its_steps():
    scheduler, block_manager, executor = make_engine(400, block_size=4, max_num_batched_tokens=32)
    add(scheduler, "short", [1, 2, 3], temperature=0, max_tokens=20, ignore_eos=True)
    scheduler.step(executor)  # short is decoding from here on
    add(scheduler, "long", list(range(100)), temperature=0, max_tokens=2, ignore_eos=True)
    run_to_completion(scheduler, executor, block_manager)
    long_chunks = [
        (r.start_position, len(r.token_ids), any(o.request_id == "short" for o in step.requests))
        for step in executor.steps for r in step.requests if r.request_id == "long"
    ]
    # 100 prompt tokens at 31 per step (one token of the budget goes to the decode), then decodes.
    prefill = [c for c in long_chunks if c[1] > 1]
    assert [c[1] for c in prefill] == [31, 31, 31, 7]
    assert all(shared for _, _, shared in prefill), "decodes must run in the same steps as the chunks"
    samples = [r.sample for step in executor.steps for r in step.requests if r.request_id == "long"]
    assert samples[:4] == [False, False, False, True], "only the chunk that ends the prompt samples"


def test_without_chunked_prefill_a_prompt_runs_whole():
    scheduler, block_manager, executor = make_engine(
        400, block_size=4, max_num_batched_tokens=128, max_model_len=128, enable_chunked_prefill=False
    )
    add(scheduler, "a", list(range(100)), temperature=0, max_tokens=3, ignore_eos=True)
    add(scheduler, "b", list(range(200, 290)), temperature=0, max_tokens=3, ignore_eos=True)
    run_to_completion(scheduler, executor, block_manager)
    first, second = executor.steps[0], executor.steps[1]
    assert [(r.request_id, len(r.token_ids)) for r in first.requests] == [("a", 100)]
    assert ("b", 90) in [(r.request_id, len(r.token_ids)) for r in second.requests]


def test_stop_conditions():
    scheduler, block_manager, executor = make_engine(200, block_size=4)
    executor.eos_after = {"eos": 8, "eos_ignored": 8, "eos_min": 8}
    add(scheduler, "length", [1, 2, 3], temperature=0, max_tokens=5)
    add(scheduler, "eos", [1, 2, 3], temperature=0, max_tokens=50)
    add(scheduler, "eos_ignored", [1, 2, 3], temperature=0, max_tokens=12, ignore_eos=True)
    add(scheduler, "eos_min", [1, 2, 3], temperature=0, max_tokens=50, min_tokens=9)
    first_token = executor.next_token("x", [1, 2, 3])
    add(scheduler, "stop_id", [1, 2, 3], temperature=0, max_tokens=50, stop_token_ids=[first_token])
    finish = {}
    outputs = {}
    while scheduler.has_unfinished_requests():
        for out in scheduler.step(executor):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    assert finish["length"] == "length" and len(outputs["length"]) == 5
    # The prompt has 3 tokens, so the 6th output makes the sequence 8 long and the 7th is EOS.
    assert finish["eos"] == "stop" and outputs["eos"][-1] == EOS and len(outputs["eos"]) == 6
    assert finish["eos_ignored"] == "length" and len(outputs["eos_ignored"]) == 12
    assert EOS in outputs["eos_ignored"]
    # min_tokens: EOS before the 9th token does not stop (the real executor also masks it).
    assert finish["eos_min"] == "stop" and len(outputs["eos_min"]) == 9
    assert finish["stop_id"] == "stop" and outputs["stop_id"] == [first_token]


def test_max_model_len_ends_a_request_with_length():
    scheduler, block_manager, executor = make_engine(200, block_size=4, max_model_len=20)
    add(scheduler, "r", list(range(15)), temperature=0, max_tokens=None, ignore_eos=True)
    outputs = run_to_completion(scheduler, executor, block_manager)
    assert len(outputs["r"]) == 5
    with pytest.raises(ValueError, match="context length"):
        add(scheduler, "too-long", list(range(20)), temperature=0)


def test_abort_frees_blocks_on_the_next_step():
    scheduler, block_manager, executor = make_engine(100, block_size=4)
    add(scheduler, "keep", list(range(10)), temperature=0, max_tokens=50, ignore_eos=True)
    add(scheduler, "drop", list(range(100, 130)), temperature=0, max_tokens=50, ignore_eos=True)
    scheduler.step(executor)
    held = len(block_manager.block_ids("drop"))
    assert held > 0
    free_before = block_manager.num_free_blocks
    output = scheduler.abort_request("drop")
    assert output.finish_reason == "abort"
    scheduler.step(executor)
    assert block_manager.block_ids("drop") == []
    assert "drop" not in executor.block_tables
    assert block_manager.num_free_blocks >= free_before + held - 1  # keep may have taken one block
    assert scheduler.abort_request("drop") is None


def test_rejects_duplicate_ids_and_empty_prompts():
    scheduler, _, _ = make_engine(10)
    add(scheduler, "a", [1])
    with pytest.raises(ValueError, match="already in use"):
        add(scheduler, "a", [1])
    with pytest.raises(ValueError, match="at least one token"):
        add(scheduler, "b", [])


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("max_num_batched_tokens", -1), ("block_size", 1.5)])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler, block_manager, executor = make_engine(400, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    order = []
    for request_id, priority in [("late-low", 2), ("high", 0), ("mid-a", 1), ("mid-b", 1)]:
        request = Request(request_id, [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                          (EOS,), scheduler.config.max_model_len, priority=priority)
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        for output in scheduler.step(executor):
            if output.finished:
                order.append(output.request_id)
    assert order == ["high", "mid-a", "mid-b", "late-low"]


def test_long_prefill_threshold_caps_each_steps_chunk():
    scheduler, block_manager, executor = make_engine(400, block_size=4, max_num_batched_tokens=64,
                                                     long_prefill_token_threshold=16)
    add(scheduler, "short", [1, 2, 3], temperature=0, max_tokens=20, ignore_eos=True)
    scheduler.step(executor)
    add(scheduler, "long", list(range(100)), temperature=0, max_tokens=2, ignore_eos=True)
    run_to_completion(scheduler, executor, block_manager)
    chunks = [len(r.token_ids) for step in executor.steps for r in step.requests if r.request_id == "long"]
    assert chunks[:7] == [16] * 6 + [4], "the 100-token prompt goes in chunks of at most 16"


def test_max_num_partial_prefills_lets_short_prompts_past_a_second_long_one():
    scheduler, block_manager, executor = make_engine(400, block_size=4, max_num_batched_tokens=40,
                                                     long_prefill_token_threshold=16, max_num_partial_prefills=1)
    add(scheduler, "long-a", list(range(100)), temperature=0, max_tokens=1, ignore_eos=True)
    add(scheduler, "long-b", list(range(200, 300)), temperature=0, max_tokens=1, ignore_eos=True)
    add(scheduler, "short", [5, 6, 7], temperature=0, max_tokens=1, ignore_eos=True)
    first = scheduler.step(executor)
    step = executor.steps[0]
    # long-a takes the one partial slot; long-b would be a second partial prefill and waits; short fits.
    assert [r.request_id for r in step.requests] == ["long-a", "short"]
    assert [o.request_id for o in first] == ["short"]
    run_to_completion(scheduler, executor, block_manager)
    for step in executor.steps:
        partial = [r for r in step.requests if not r.sample]
        assert len(partial) <= 1


def test_a_deferred_request_computes_its_last_token_again_and_then_samples():
    """The executor defers a request whose grammar is still compiling: the scheduler sends its last token
    again (the checking executor would fail on a gap or an overlap) and its output is what it would have been."""
    prompts = random_prompts(3, seed=3)
    scheduler, block_manager, checking = make_engine(200, block_size=4, max_num_batched_tokens=32)
    for i, prompt in enumerate(prompts):
        add(scheduler, f"r{i}", prompt, temperature=0, max_tokens=6, ignore_eos=True)
    reference = run_to_completion(scheduler, checking, block_manager)

    scheduler, block_manager, checking = make_engine(200, block_size=4, max_num_batched_tokens=32)
    deferrals = {"r1": 3}  # r1 reaches its sampling position three times before it is sampled

    def deferring(step: ExecuteStep) -> ExecuteResult:
        result = checking(step)
        for req in step.requests:
            if req.request_id in result.sampled and deferrals.get(req.request_id):
                deferrals[req.request_id] -= 1
                del result.sampled[req.request_id]
                result.deferred.append(req.request_id)
                checking.progress[req.request_id] -= 1  # the executor keeps nothing of a deferred token
        return result

    for i, prompt in enumerate(prompts):
        add(scheduler, f"r{i}", prompt, temperature=0, max_tokens=6, ignore_eos=True)
    assert run_to_completion(scheduler, deferring, block_manager) == reference
    assert scheduler.num_recomputed_tokens == 3
    last = len(prompts[1]) - 1
    resent = [len(r.token_ids) for step in checking.steps for r in step.requests
              if r.request_id == "r1" and r.start_position == last]
    assert resent == [1] * 3, "the last prompt token is computed again, alone, until it is sampled"


class PromptLogprobsExecutor(CheckingExecutor):
    """Returns, for a request that asks, the "logprob" -position of every prompt token its step computes past
    the first (carrying a chunk's last row to the next chunk, as the model runner does)."""

    def __init__(self, *args, prompts: dict[str, list[int]]):
        super().__init__(*args)
        self.prompts = prompts

    def __call__(self, step: ExecuteStep) -> ExecuteResult:
        result = super().__call__(step)
        for req in step.requests:
            if req.prompt_logprobs:
                prompt = self.prompts[req.request_id]
                start = max(req.start_position, 1)
                end = min(req.start_position + len(req.token_ids), len(prompt))
                result.prompt_logprobs[req.request_id] = PromptLogprobs(
                    start, [SampledToken(prompt[p], -float(p), [], []) for p in range(start, end)])
        return result


def test_prompt_logprobs_come_once_whole_in_order_and_never_from_the_prefix_cache():
    prompt = list(range(1, 31))
    block_manager = KVCacheManager(200, 4)
    scheduler = Scheduler(SchedulerConfig(block_size=4, max_model_len=512, max_num_batched_tokens=8),
                          one_executor(block_manager.step))
    executor = PromptLogprobsExecutor(block_manager, 4, prompts={"warm": prompt, "asks": prompt})
    add(scheduler, "warm", prompt, temperature=0, max_tokens=2, ignore_eos=True)
    run_to_completion(scheduler, executor, block_manager)  # the prompt's full blocks are now cached

    add(scheduler, "asks", prompt, temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    outputs = [o for _ in range(2) for o in scheduler.step(executor)]
    assert outputs == [] and len(scheduler.requests["asks"].prompt_logprobs) == 15
    # The next step fails: the request is recomputed from its first token, and what it had is kept.
    step = scheduler.schedule()
    scheduler.steps_failed([step], None)
    sent = []
    while scheduler.has_unfinished_requests():
        sent += [o.prompt_logprobs for o in scheduler.step(executor) if o.prompt_logprobs is not None]
    assert sent == [[SampledToken(prompt[p], -float(p), [], []) for p in range(1, 30)]]
    admissions = [r.start_position for s in executor.steps for r in s.requests
                  if r.request_id == "asks" and r.sampling_params is not None]
    assert admissions == [0, 0], "a cached prefix would leave its prompt logprobs uncomputed"
    decodes = [r for s in executor.steps for r in s.requests if r.request_id == "asks" and r.start_position >= 30]
    assert decodes and not any(r.prompt_logprobs for r in decodes), "asked only while some are missing"


def test_a_requests_first_token_carries_its_queue_and_prefill_times(monkeypatch):
    import scheduler_svc.scheduler as scheduler_module

    clock = [0.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: clock[0])
    scheduler, block_manager, executor = make_engine(200, block_size=4, max_num_seqs=1)
    add(scheduler, "a", [1, 2, 3], temperature=0, max_tokens=3, ignore_eos=True)
    add(scheduler, "b", [4, 5, 6], temperature=0, max_tokens=2, ignore_eos=True)  # waits for a (one seq at a time)

    def one_second_a_step(step):
        clock[0] += 1.0
        return executor(step)

    clock[0] = 10.0
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += scheduler.step(one_second_a_step)
    timed = {o.request_id: (o.queue_time_s, o.prefill_time_s) for o in outputs if o.queue_time_s is not None}
    firsts = {}
    for o in outputs:
        firsts.setdefault(o.request_id, o)
    assert all(firsts[r].queue_time_s is not None for r in "ab"), "the first output carries them"
    assert sum(o.queue_time_s is not None for o in outputs) == 2, "once per request"
    assert timed["a"] == (10.0, 1.0)  # admitted at 10, its first token a step (1 s) later
    assert timed["b"][0] == 13.0 and timed["b"][1] == 1.0  # admitted once a's 3 steps ended
