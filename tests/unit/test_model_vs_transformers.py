"""The flat-batch model against transformers on tiny random-weight configs, logits at every step."""
from __future__ import annotations

import random

import pytest
import torch

from executor_svc.model_runner import ModelRunner
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteRequest, ExecuteStep

TOLERANCE = 1e-4
BLOCK_SIZE = 8


def tiny_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "llama3-rope":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
        })
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    raise ValueError(kind)


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3-rope"])
def tiny_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_config(request.param), dtype=torch.float32).eval()
    # Random init leaves biases at zero; give them values so a dropped bias shows.
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    return path, hf_model


class TeacherForcedDriver:
    """Feeds fixed token sequences through the runner in chosen chunk sizes, blocks from a shuffled pool."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free_blocks = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks_held: dict[str, int] = {}

    def request(self, request_id: str, tokens: list[int], start: int, count: int) -> ExecuteRequest:
        end = start + count
        needed = -(-end // BLOCK_SIZE) - self.blocks_held.get(request_id, 0)
        new_blocks = [self.free_blocks.pop() for _ in range(needed)]
        first = request_id not in self.blocks_held
        self.blocks_held[request_id] = self.blocks_held.get(request_id, 0) + needed
        return ExecuteRequest(
            request_id, tokens[start:end], start, new_blocks, sample=True,
            sampling_params=SamplingParams(temperature=0) if first else None,
        )


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def test_mixed_batch_logits_match_transformers_at_every_step(tiny_model):
    path, hf_model = tiny_model
    runner = ModelRunner(str(path), block_size=BLOCK_SIZE, kv_cache_memory=1 << 20)
    driver = TeacherForcedDriver(runner)
    gen = random.Random(1)
    sequences = {name: [gen.randrange(160) for _ in range(200)] for name in ("fresh", "chunked", "decoding")}
    expected = {name: reference_logits(hf_model, seq) for name, seq in sequences.items()}

    # "decoding" is prefilled a step early, so every later step mixes its decode with a fresh prompt
    # (whole, then decoding) and a prompt prefilled in chunks of 1, 7, 16 and 33 tokens.
    chunk_cycle = [1, 7, 16, 33]
    step_plans = [[("decoding", 30)]]
    for step in range(12):
        step_plans.append([("decoding", 1), ("fresh", 50 if step == 0 else 1), ("chunked", chunk_cycle[step % 4])])

    progress = {name: 0 for name in sequences}
    checked = 0
    for plan in step_plans:
        requests = [driver.request(name, sequences[name], progress[name], n) for name, n in plan]
        logits = runner.step_logits(ExecuteStep(requests))
        for name, n in plan:
            progress[name] += n
            diff = (logits[name] - expected[name][progress[name] - 1]).abs().max().item()
            assert diff < TOLERANCE, f"{name} at position {progress[name] - 1}: max abs diff {diff}"
            checked += 1
    assert checked == 1 + 12 * 3


def test_chunked_and_unchunked_prefill_give_the_same_logits(tiny_model):
    path, _ = tiny_model
    tokens = [random.Random(2).randrange(160) for _ in range(90)]
    logits = {}
    for chunks in ([90], [1, 7, 16, 33, 33], [33, 16, 7, 1, 33]):
        runner = ModelRunner(str(path), block_size=BLOCK_SIZE, kv_cache_memory=1 << 20)
        driver = TeacherForcedDriver(runner, seed=len(chunks))
        start = 0
        for n in chunks:
            out = runner.step_logits(ExecuteStep([driver.request("r", tokens, start, n)]))
            start += n
        logits[tuple(chunks)] = out["r"]
    reference = logits[(90,)]
    for chunks, value in logits.items():
        assert (value - reference).abs().max().item() < 1e-5, chunks
