"""Preemption by swap, recompute and the automatic choice with the default model in float32: with a KV pool a
quarter of what the load needs, every request finishes with the tokens (and logprobs) of an unconstrained
run, and the swap space holds nothing once its requests have resumed or ended."""
from __future__ import annotations

import random

import pytest
import torch

from executor_svc.model_config import ModelArchitecture
from executor_svc.model_loader import resolve_model_dir
from pagedserve import LLM, SamplingParams
from scheduler_svc.request import Request

BLOCK = 16
# Logprobs make the comparison sensitive to any K/V that is not the request's own.
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
PROMPTS = [[rng.randrange(1, 49152) for _ in range(rng.randint(16, 56))] for rng in map(random.Random, range(8))]
NEEDED_BLOCKS = sum(-(-(len(p) + PARAMS.max_tokens) // BLOCK) for p in PROMPTS)


def default_llm(num_blocks: int | None = None, **kwargs) -> LLM:
    from transformers import AutoConfig

    architecture = ModelArchitecture.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir("default")))
    block_bytes = architecture.kv_bytes_per_token(torch.float32) * BLOCK
    return LLM("default", device="cpu", dtype="float32", block_size=BLOCK,
               kv_cache_memory=(num_blocks or NEEDED_BLOCKS) * block_bytes, **kwargs)


@pytest.fixture(scope="module")
def unconstrained():
    llm = default_llm()
    results = llm.generate(PROMPTS, PARAMS)
    assert llm.scheduler.num_preemptions == 0
    return results


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_a_quarter_pool_gives_the_unconstrained_outputs_in_every_preemption_mode(unconstrained, mode):
    llm = default_llm(NEEDED_BLOCKS // 4, preemption_mode=mode)
    assert llm.runner.num_blocks == NEEDED_BLOCKS // 4
    results = llm.generate(PROMPTS, PARAMS)
    assert all(r.finish_reason == "length" for r in results)
    assert [r.token_ids for r in results] == [r.token_ids for r in unconstrained]
    for constrained, reference in zip(results, unconstrained):
        assert [e.logprob for e in constrained.logprobs] == pytest.approx([e.logprob for e in reference.logprobs],
                                                                          abs=1e-4)
    manager, runner = llm.block_manager, llm.runner
    assert llm.scheduler.num_preemptions == manager.num_preemptions > 0
    if mode == "recompute":
        assert manager.num_swaps == manager.blocks_swapped_in == 0
    else:
        # auto: on the CPU a block's copy out and back costs a small fraction of recomputing its 16 tokens. A
        # request preempted while its first chunk is still in flight has no computed KV to copy: recomputed.
        assert 0 < manager.num_swaps <= manager.num_preemptions and manager.blocks_swapped_in > 0
    # What was not recomputed came from host memory: swapped copies, or prefix blocks the pool evicted to the tier.
    assert runner.blocks_loaded == manager.blocks_swapped_in + manager.tier_hits // BLOCK
    assert runner.failed_loads == 0
    assert manager.swapped == {} and runner.swap_space.num_bytes == 0


def test_the_copies_of_a_request_aborted_while_swapped_out_are_freed(unconstrained):
    llm = default_llm(NEEDED_BLOCKS // 4, preemption_mode="swap")
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for output in llm.scheduler.step(llm.runner.execute):
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)

    for i, prompt in enumerate(PROMPTS):
        llm.scheduler.add_request(Request(str(i), prompt, PARAMS, llm.eos_token_ids, llm.max_model_len))
    while not llm.block_manager.swapped:
        step()
    aborted = next(iter(llm.block_manager.swapped))
    swap_space = llm.runner.swap_space
    held = set(llm.block_manager.swapped[aborted].block_hashes)
    assert held <= swap_space.blocks.keys()  # copied before the step that preempted it ran
    assert llm.scheduler.abort_request(aborted).finish_reason == "abort"
    step()
    assert aborted not in llm.block_manager.swapped
    others = {h for record in llm.block_manager.swapped.values() for h in record.block_hashes}
    assert held - others and not (held - others) & swap_space.blocks.keys()
    while llm.scheduler.has_unfinished_requests():
        step()
    assert swap_space.num_bytes == 0 and swap_space.blocks == {} and llm.block_manager.swapped == {}
    for request_id, tokens in outputs.items():
        if request_id != aborted:
            assert tokens == unconstrained[int(request_id)].token_ids, request_id
