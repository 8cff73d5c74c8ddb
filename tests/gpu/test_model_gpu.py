"""The whole model through ModelRunner on CUDA with the CuPy kernels, against transformers on the same GPU.

Random-weight Llama, Qwen2, Qwen3, Gemma 2 and 3, Phi-3, Qwen2-MoE and OLMo 2 checkpoints are written here (head sizes the kernels implement: 64
and 128; GQA ratios 2, 4 and 7). bfloat16: logits of every step of a mixed batch (a fresh prompt, a prompt fed in
chunks, a decoding sequence) within bf16 tolerance of transformers in bf16, and a float32 model over a bfloat16 KV
cache within the same tolerance of transformers in float32. float32: greedy tokens equal to
transformers' choices on the same sequence. The runners capture CUDA graphs, so their decode-only steps
are graph replays.
"""
from __future__ import annotations

import random

import pytest
import torch

from executor_svc.attention.cupy_backend import CupyPagedAttention
from executor_svc.model_runner import ModelRunner
from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteRequest, ExecuteStep

BLOCK_SIZE = 16
VOCAB = 256


def write_model(kind: str, path, seed: int = 0):
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, Olmo2Config,
                              Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config)

    common = dict(vocab_size=VOCAB, intermediate_size=384, num_hidden_layers=2, max_position_embeddings=1024,
                  eos_token_id=VOCAB - 1, bos_token_id=0)
    if kind == "llama":  # 4 heads over 2 KV heads, head_dim 64
        config = LlamaConfig(**common, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif kind == "llama-d128":  # 4 heads over 2 KV heads, head_dim 128
        config = LlamaConfig(**common, hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif kind == "qwen2":  # 7 heads over 1 KV head, head_dim 64, q/k/v biases
        config = Qwen2Config(**common, hidden_size=448, num_attention_heads=7, num_key_value_heads=1,
                             tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif kind == "qwen3":  # 8 heads over 2 KV heads, head_dim 128 (not hidden / heads), per-head q/k norms
        config = Qwen3Config(**common, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                             tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif kind == "gemma3":  # 4 heads over 2 KV heads, head_dim 128, sandwich norms, two rotary tables, a window
        config = Gemma3TextConfig(**common, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=128, query_pre_attn_scalar=128, tie_word_embeddings=True,
                                  layer_types=["sliding_attention", "full_attention"], sliding_window=40,
                                  pad_token_id=None)
    elif kind == "gemma2":  # head_dim 64, a window, caps on the scores and the logits tight enough to bend them
        config = Gemma2Config(**common, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              query_pre_attn_scalar=64, tie_word_embeddings=True, sliding_window=60,
                              attn_logit_softcapping=1.5, final_logit_softcapping=4.0, pad_token_id=None)
    elif kind == "phi3":  # 4 heads over 1 KV head, head_dim 64, fused q/k/v and gate/up, half-turned heads, a window
        config = Phi3Config(**common, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                            tie_word_embeddings=False, sliding_window=300, pad_token_id=None,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5})
    elif kind == "qwen2_moe":  # head_dim 64, 2 of 8 experts unrenormalised and a gated shared expert; layer 0 dense
        config = Qwen2MoeConfig(**common, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=128, shared_expert_intermediate_size=256, mlp_only_layers=[0])
    elif kind == "olmo2":  # head_dim 64, norms on each sublayer's output only, q/k norms over the whole projection
        config = Olmo2Config(**common, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                             tie_word_embeddings=False, pad_token_id=None)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # zero at init: randomise so a dropped bias shows
                param.normal_(0, 0.5)
            if name.endswith("norm.weight"):  # ones (Gemma's: zeros) at init: so that a swapped one shows
                param.normal_(1, 0.5)
            if ".mlp.gate." in name or "expert" in name:  # routers and experts loud enough that a wrong pick shows
                param.mul_(10)
    model.save_pretrained(path)


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-d128", "qwen3", "gemma3", "gemma2", "phi3",
                                             "qwen2_moe", "olmo2"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_model(request.param, path)
    return path


def cupy_runner(path, dtype: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    """The runner with the CuPy backend; decode steps replay CUDA graphs (a mixture of experts' run eagerly)."""
    runner = ModelRunner(ModelConfig(str(path), dtype=dtype, device="cuda", attention_backend="cupy"),
                         CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=64 << 20, kv_cache_dtype=kv_cache_dtype))
    assert runner.attention_backend_name == "cupy" and isinstance(runner.attention, CupyPagedAttention)
    assert all(layer.self_attn.backend is runner.attention for layer in runner.model.layers)
    assert (runner.decode_graphs is None) == (runner.config.moe is not None)
    return runner


def graph_replays(runner: ModelRunner) -> int:
    return runner.decode_graphs.num_replays if runner.decode_graphs is not None else 0


class Driver:
    """Feeds token sequences through the runner in chosen chunks, blocks drawn from a shuffled pool."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.held: dict[str, int] = {}

    def request(self, rid: str, tokens: list[int], start: int, count: int) -> ExecuteRequest:
        needed = -(-(start + count) // BLOCK_SIZE) - self.held.get(rid, 0)
        first = rid not in self.held
        self.held[rid] = self.held.get(rid, 0) + needed
        return ExecuteRequest(rid, tokens[start : start + count], start, [self.free.pop() for _ in range(needed)],
                              sample=True, sampling_params=SamplingParams(temperature=0) if first else None)


def hf_model(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens], device="cuda")).logits[0].float()


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "auto"), ("float32", "bfloat16")])
def test_bfloat16_logits_match_transformers_at_every_step(model_dir, dtype, kv_cache_dtype):
    # A float32 model over a bfloat16 KV cache runs attention in bfloat16: within the same tolerance of float32.
    runner = cupy_runner(model_dir, dtype, kv_cache_dtype)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    reference = hf_model(model_dir, getattr(torch, dtype))
    driver = Driver(runner)
    gen = random.Random(1)
    sequences = {name: [gen.randrange(VOCAB - 1) for _ in range(700)] for name in ("fresh", "chunked", "decoding")}
    expected = {name: hf_logits(reference, seq) for name, seq in sequences.items()}
    chunk_cycle = [1, 7, 16, 33, 70]
    plans = [[("decoding", 600)]]  # past 256 keys: its decode rows take the split-K path
    for step in range(12):
        plans.append([("decoding", 1), ("fresh", 90 if step == 0 else 1), ("chunked", chunk_cycle[step % 5])])
    progress = {name: 0 for name in sequences}
    for plan in plans:
        requests = [driver.request(name, sequences[name], progress[name], n) for name, n in plan]
        logits = runner.step_logits(ExecuteStep(requests))
        for name, n in plan:
            progress[name] += n
            ref = expected[name][progress[name] - 1]
            diff = (logits[name] - ref).abs().max().item()
            assert diff < 0.02 * ref.abs().max().item() + 1e-2, f"{name} at position {progress[name] - 1}: {diff}"
    assert graph_replays(runner) == (0 if runner.config.moe else 2)  # the steps where every row is one token


def test_float32_greedy_tokens_match_transformers(model_dir):
    runner = cupy_runner(model_dir, "float32")
    reference = hf_model(model_dir, torch.float32)
    driver = Driver(runner, seed=1)
    gen = random.Random(2)
    prompts = {"a": [gen.randrange(VOCAB - 1) for _ in range(50)], "b": [gen.randrange(VOCAB - 1) for _ in range(20)]}
    sequences = {rid: list(p) for rid, p in prompts.items()}
    # Step 1: the first 32 tokens of "a"; step 2: the rest of "a" and all of "b"; then both decode.
    for step in range(2 + 24):
        if step < 2:
            plan = [[("a", 0, 32)], [("a", 32, 18), ("b", 0, 20)]][step]
        else:
            plan = [(rid, len(seq) - 1, 1) for rid, seq in sequences.items()]
        requests = [driver.request(rid, sequences[rid], start, count) for rid, start, count in plan]
        logits = runner.step_logits(ExecuteStep(requests))
        for rid, start, count in plan:
            if start + count == len(sequences[rid]):  # the chunk ends the known tokens: extend greedily
                sequences[rid].append(int(logits[rid].argmax()))
    for rid, seq in sequences.items():
        full = hf_logits(reference, seq)
        prompt_len = len(prompts[rid])
        choices = full[prompt_len - 1 : len(seq) - 1].argmax(-1).tolist()
        assert choices == seq[prompt_len:], rid
    assert graph_replays(runner) == (0 if runner.config.moe else 24)
