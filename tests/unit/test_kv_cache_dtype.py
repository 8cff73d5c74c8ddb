"""kv_cache_dtype: a float32 model over a bfloat16 KV cache (attention run in bfloat16, the rest in float32)."""
from __future__ import annotations

import random

import pytest
import torch

from executor_svc.model_runner import ModelRunner
from executor_svc.server import executor_info
from pagedserve import LLM, SamplingParams
from pagedserve.config import CacheConfig, ModelConfig
from tests.conftest import write_tiny_model
from tests.unit.test_model_vs_transformers import BLOCK_SIZE, logits_by_chunk, reference_logits


def runner_for(path, kv_cache_dtype: str, backend: str = "auto", memory: int = 1 << 20) -> ModelRunner:
    return ModelRunner(ModelConfig(str(path), dtype="float32", device="cpu", attention_backend=backend),
                       CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=memory, kv_cache_dtype=kv_cache_dtype))


@pytest.mark.parametrize("kind,backend", [("llama", "cpu"), ("llama", "torch"), ("gemma2", "cpu"), ("qwen3", "cpu")])
def test_logits_stray_from_float32_no_further_than_a_bfloat16_model_does(kind, backend, tmp_path):
    # Only attention is rounded, so the logits must stay at least as close to float32's as transformers' all-
    # bfloat16 run (gemma2: sliding window and soft cap; qwen3: per-head q/k norms before the cast).
    hf_model = write_tiny_model(kind, tmp_path)
    hf_bf16 = type(hf_model).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    runner = runner_for(tmp_path, "bfloat16", backend)
    assert runner.attention_backend_name == backend
    assert {k.dtype for pair in runner.kv_caches for k in pair} == {torch.bfloat16}
    assert {p.dtype for p in runner.model.parameters()} == {torch.float32}
    tokens = random.Random(5).choices(range(160), k=64)
    exact, rounded = reference_logits(hf_model, tokens), reference_logits(hf_bf16, tokens)
    largest = 0.0
    for position, logits in logits_by_chunk(runner, tokens, (40, 1, 1, 7, 15)):
        assert logits.dtype == torch.float32
        ours = (logits - exact[position]).abs().max().item()
        theirs = (rounded[position] - exact[position]).abs().max().item()
        assert ours < theirs + 0.005 * exact[position].abs().max().item(), (position, ours, theirs)
        largest = max(largest, ours)
    assert largest > 1e-6  # the K/V really were rounded


def test_the_pool_holds_twice_the_blocks_and_its_prefixes_are_rooted_apart(tiny_llama_dir):
    full, half = runner_for(tiny_llama_dir, "auto"), runner_for(tiny_llama_dir, "bfloat16")
    assert half.num_blocks == 2 * full.num_blocks and half.block_bytes * 2 == full.block_bytes
    # K/V computed in another dtype never answer for a prefix (in the pool, the offload tier or Redis).
    assert half.model_id != full.model_id and half.model_id.startswith(full.model_id)
    assert runner_for(tiny_llama_dir, "float32").model_id == full.model_id  # float32 is the model's own
    assert (executor_info(full).kv_cache_dtype, executor_info(half).kv_cache_dtype) == ("float32", "bfloat16")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_come_back_to_the_same_outputs(tiny_llama_dir, mode):
    # Swapped blocks travel as bytes of the cache's dtype; read back as float32 they would be garbage.
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 150) for _ in range(rng.randint(5, 40))] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    ample = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_dtype="bfloat16",
                kv_cache_memory=4 << 20)
    unconstrained = ample.generate(prompts, params)
    needed = sum(-(-(len(p) + 24) // 16) for p in prompts)
    small = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_dtype="bfloat16",
                kv_cache_memory=(needed // 4) * ample.runner.block_bytes, preemption_mode=mode)
    assert small.runner.kv_caches[0][0].dtype == torch.bfloat16
    constrained = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    if mode == "swap":
        assert small.block_manager.num_swaps > 0
    assert [r.token_ids for r in constrained] == [r.token_ids for r in unconstrained]
    # Batches of another shape round attention's bfloat16 output differently now and then (a unit in the last
    # place, 0.4%): logprobs agree to that, where K/V misread would move them by whole units.
    for a, b in zip(constrained, unconstrained):
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-2)
