"""Shared fixtures: tiny random-weight checkpoints written by transformers, and the default model."""
from __future__ import annotations

import pytest
import torch


def tiny_hf_config(kind: str, vocab_size: int = 160, max_position_embeddings: int = 512, **overrides):
    """A tiny config of the kind; overrides: of the sizes all kinds share (hidden_size, ...)."""
    from transformers import (Exaone4Config, Gemma2Config, Gemma3TextConfig, GraniteConfig, GraniteMoeConfig,
                              GraniteMoeSharedConfig, HeliumConfig, LlamaConfig, MinistralConfig, MistralConfig,
                              MixtralConfig, Olmo2Config, Olmo3Config, OlmoeConfig, Phi3Config, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SeedOssConfig, SmolLM3Config)

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        eos_token_id=vocab_size - 1, bos_token_id=0,
    ) | overrides
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "llama3-rope":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
        })
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if kind == "qwen3":  # a head_dim of its own, not hidden_size / heads, as Qwen3's configs have
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if kind == "smollm3":  # the rotary embedding left out of layer 1
        return SmolLM3Config(**common, tie_word_embeddings=True, no_rope_layers=[1, 0], pad_token_id=None,
                             rope_parameters={"rope_type": "default", "rope_theta": 2000000.0})
    if kind == "granite":  # multipliers away from 1, the attention scale not head_dim ** -0.5
        return GraniteConfig(**common, tie_word_embeddings=True, embedding_multiplier=3.0, residual_multiplier=0.4,
                             attention_multiplier=0.11, logits_scaling=2.5,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "gemma3":  # a sliding and a full-attention layer, each with its rotary table; head_dim its own
        return Gemma3TextConfig(**common, head_dim=32, query_pre_attn_scalar=24, tie_word_embeddings=True,
                                layer_types=["sliding_attention", "full_attention"], sliding_window=24,
                                pad_token_id=None)
    if kind == "gemma2":  # Gemma 3's layers without q/k norms, caps on the scores and logits tight enough to bend them
        return Gemma2Config(**common, head_dim=32, query_pre_attn_scalar=24, tie_word_embeddings=True,
                            sliding_window=24, attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                            pad_token_id=None)
    if kind == "mistral":  # a sliding window on every layer, as Mistral 7B v0.1 has
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=40)
    if kind == "phi3":  # fused q/k/v and gate/up, a sliding window, LongRoPE turning half of each head
        return Phi3Config(**common, tie_word_embeddings=False, sliding_window=48, pad_token_id=None,
                          original_max_position_embeddings=256, rope_parameters={
                              "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "short_factor": [1.0, 1.3, 2.0, 3.5], "long_factor": [2.0, 4.0, 8.0, 16.0]})
    if kind == "mixtral":  # 2 of 4 experts a token, their weights renormalised
        return MixtralConfig(**common, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen2_moe":  # 3 of 6 experts unrenormalised, a gated shared expert; layer 0 dense
        return Qwen2MoeConfig(**common, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=3,
                              moe_intermediate_size=48, shared_expert_intermediate_size=80, norm_topk_prob=False,
                              mlp_only_layers=[0])
    if kind == "qwen3_moe":  # 2 of 8 experts renormalised, q/k norms; layer 0 dense by decoder_sparse_step
        return Qwen3MoeConfig(**common, head_dim=32, tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=40, norm_topk_prob=True, decoder_sparse_step=2)
    if kind == "granitemoe":  # Granite's multipliers; a softmax over each token's top 2 of 4 logits
        return GraniteMoeConfig(**common, tie_word_embeddings=True, num_local_experts=4, num_experts_per_tok=2,
                                embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.11,
                                logits_scaling=2.5)
    if kind == "granitemoeshared":  # and an ungated shared MLP
        return GraniteMoeSharedConfig(**common, tie_word_embeddings=True, num_local_experts=4, num_experts_per_tok=2,
                                      shared_intermediate_size=80, residual_multiplier=0.4)
    if kind == "olmoe":  # q/k norms over the whole projection, q/k/v clipped
        return OlmoeConfig(**common, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                           clip_qkv=1.2, pad_token_id=None)
    if kind == "olmo2":  # norms on each sublayer's output only, q/k norms over the whole projection
        return Olmo2Config(**common, tie_word_embeddings=False, pad_token_id=None)
    if kind == "olmo3":  # and a sliding and a full-attention layer, each with its rotary table
        return Olmo3Config(**common, tie_word_embeddings=False, pad_token_id=None, sliding_window=24,
                           layer_types=["sliding_attention", "full_attention"], rope_parameters={
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 500000.0}})
    if kind == "ministral":  # Mistral with a sliding and a full-attention layer
        return MinistralConfig(**common, head_dim=16, tie_word_embeddings=False, sliding_window=24,
                               layer_types=["sliding_attention", "full_attention"])
    if kind == "exaone4":  # post norms, per-head q/k norms, the rotary embedding on the sliding layer alone
        return Exaone4Config(**common, tie_word_embeddings=False, sliding_window=24,
                             layer_types=["sliding_attention", "full_attention"])
    if kind == "seed_oss":  # q/k/v biases without an o bias, a head_dim of its own
        return SeedOssConfig(**common, head_dim=32, tie_word_embeddings=False, attention_bias=True,
                             attention_out_bias=False, pad_token_id=None)
    if kind == "helium":  # the rotary embedding on interleaved pairs, q/k/v biases
        return HeliumConfig(**common, head_dim=16, tie_word_embeddings=False, attention_bias=True, pad_token_id=None)
    raise ValueError(kind)


def write_tiny_model(kind: str, path, seed: int = 0, edit_config=None, **config_overrides):
    """Saves a random-weight transformers model (biases and per-head q/k norms randomised too) and returns it;
    edit_config, if given, changes the kind's config first (a field of that kind alone)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config(kind, **config_overrides)
    if edit_config is not None:
        edit_config(config)
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
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_model("llama", path)
    return path


@pytest.fixture(scope="session")
def tiny_model_with_tokenizer(tmp_path_factory):
    """A tiny random Llama whose ids all decode with the default model's tokenizer (the frontend needs one)."""
    from tests.support.tiny_stack import write_tiny_model_with_tokenizer

    return write_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-llama-tokenized"))


@pytest.fixture
def redis_server():
    from tests.support.local_redis import LocalRedis

    try:
        server = LocalRedis()
    except RuntimeError as error:
        pytest.fail(str(error))
    yield server
    server.stop()


@pytest.fixture
def up_config(monkeypatch):
    """Runs `pagedserve up` with the given flags as far as starting the stack, and returns the configuration
    it would start the stack with (the stack itself is not started)."""
    import pagedserve.entrypoints.launcher
    from pagedserve.entrypoints import cli

    seen = []

    class Started(Exception):
        pass

    class FakeStack:
        def __init__(self, config):
            seen.append(config)

        def __enter__(self):
            raise Started

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(pagedserve.entrypoints.launcher, "Stack", FakeStack)

    def run(argv: list[str]):
        with pytest.raises(Started):
            cli.main(["up", *argv])
        return seen[-1]

    return run
