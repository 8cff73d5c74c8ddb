"""Loading checkpoints: sharded safetensors, GGUF, and clear errors for what cannot be loaded."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_svc.model_config import ModelArchitecture, parse_dtype
from executor_svc.model_loader import _gguf_key, default_model_gguf, resolve_model_dir, safetensors_files
from executor_svc.model_runner import ModelRunner
from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteRequest, ExecuteStep
from tests.conftest import tiny_hf_config, write_tiny_model


def last_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    request = ExecuteRequest("r", tokens, 0, list(range(-(-len(tokens) // runner.block_size))), True,
                             SamplingParams(temperature=0))
    return runner.step_logits(ExecuteStep([request]))["r"]


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    model = write_tiny_model("qwen2", single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 2
    tokens = [5, 9, 11, 3, 7]
    a = last_logits(ModelRunner(ModelConfig(str(single), device="cpu", dtype="float32"), CacheConfig(kv_cache_memory=1 << 20)), tokens)
    b = last_logits(ModelRunner(ModelConfig(str(sharded), device="cpu", dtype="float32"), CacheConfig(kv_cache_memory=1 << 20)), tokens)
    assert torch.equal(a, b)
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0, -1]
    assert (a - expected).abs().max().item() < 1e-4


def test_sliding_windows_are_read_per_layer_as_transformers_applies_them():
    def windows(kind, **changes):
        config = tiny_hf_config(kind)
        for name, value in changes.items():
            setattr(config, name, value)
        return ModelArchitecture.from_hf_config(config)

    assert windows("gemma3").layer_windows == (24, None)
    gemma2 = windows("gemma2")
    assert (gemma2.layer_windows, gemma2.attention_softcap, gemma2.logits_softcap) == ((24, None), 1.5, 4.0)
    assert (gemma2.layer_rope, gemma2.norm_placement, gemma2.gemma_norms, gemma2.qk_norm) == ((), "sandwich", True, False)
    assert windows("gemma3").attention_softcap is None
    with pytest.raises(ValueError, match="attn_logit_softcapping must be positive"):
        windows("gemma2", attn_logit_softcapping=0.0)
    olmo3 = windows("olmo3")
    assert (olmo3.layer_windows, olmo3.layer_rope, olmo3.norm_placement) == (
        (24, None), ("sliding_attention", "full_attention"), "post")
    assert (olmo3.qk_norm_over_heads, olmo3.float32_norm_products, olmo3.gemma_norms) == (True, True, False)
    exaone4 = windows("exaone4")
    assert (exaone4.layer_windows, exaone4.no_rope_layers, exaone4.norm_placement) == ((24, None), {1}, "post")
    assert (exaone4.qk_norm_over_heads, exaone4.float32_norm_products) == (False, False)
    assert windows("exaone4", sliding_window=None).no_rope_layers == frozenset()
    assert windows("ministral").layer_windows == (24, None)
    assert windows("mistral").layer_windows == (40, 40)
    assert windows("mistral", sliding_window=None).layer_windows == ()
    assert windows("llama").layer_windows == ()
    # Qwen2's window applies only with use_sliding_window, from layer max_window_layers on.
    from transformers import Qwen2Config
    qwen = Qwen2Config(**tiny_hf_config("qwen2").to_diff_dict() | {"use_sliding_window": True, "sliding_window": 16,
                                                                   "max_window_layers": 1, "layer_types": None})
    assert ModelArchitecture.from_hf_config(qwen).layer_windows == (None, 16)
    assert windows("qwen2", sliding_window=16).layer_windows == ()  # use_sliding_window is false
    # The context is the model's, not capped at the window.
    assert windows("gemma3").max_model_len == 512
    with pytest.raises(ValueError, match="bidirectional attention"):
        windows("gemma3", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="unsupported layer types"):
        windows("gemma3", layer_types=["chunked_attention", "full_attention"])


def test_phi3_turns_part_of_each_head_and_serves_longrope_within_its_original_context_unless_told():
    phi3 = ModelArchitecture.from_hf_config(tiny_hf_config("phi3"))
    assert (phi3.rotary_dim, phi3.head_dim, phi3.layer_windows) == (8, 16, (48, 48))
    assert phi3.max_model_len == 256  # original_max_position_embeddings, not max_position_embeddings (512)
    assert not phi3.rope_long_factors
    within = ModelArchitecture.from_hf_config(tiny_hf_config("phi3"), max_model_len=100)
    assert (within.max_model_len, within.rope_long_factors) == (100, False)
    past = ModelArchitecture.from_hf_config(tiny_hf_config("phi3"), max_model_len=300)
    assert (past.max_model_len, past.rope_long_factors) == (300, True)
    assert not torch.equal(past.rope_inv_freq()[0], phi3.rope_inv_freq()[0])
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 512\], got 513"):
        ModelArchitecture.from_hf_config(tiny_hf_config("phi3"), max_model_len=513)


def test_mixtures_of_experts_are_read_as_transformers_routes_them():
    mixtral = ModelArchitecture.from_hf_config(tiny_hf_config("mixtral")).moe
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.intermediate_size) == (4, 2, 112)
    assert (mixtral.norm_topk_prob, mixtral.weights_in_model_dtype, mixtral.layers) == (True, False, {0, 1})
    qwen2 = ModelArchitecture.from_hf_config(tiny_hf_config("qwen2_moe"))
    assert (qwen2.moe.layers, qwen2.moe.shared_expert_intermediate_size, qwen2.moe.norm_topk_prob) == ({1}, 80, False)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.layer_windows) == (True, False, ())
    qwen3 = ModelArchitecture.from_hf_config(tiny_hf_config("qwen3_moe"))
    assert (qwen3.moe.layers, qwen3.moe.shared_expert_intermediate_size, qwen3.qk_norm) == ({1}, 0, True)
    granite = ModelArchitecture.from_hf_config(tiny_hf_config("granitemoeshared")).moe
    assert (granite.softmax_over_top_k, granite.shared_expert_intermediate_size, granite.shared_expert_gated) == (
        True, 80, False)
    olmoe = ModelArchitecture.from_hf_config(tiny_hf_config("olmoe"))
    assert (olmoe.qk_norm, olmoe.qk_norm_over_heads, olmoe.qkv_clip, olmoe.moe.norm_topk_prob) == (True, True, 1.2, False)
    assert ModelArchitecture.from_hf_config(tiny_hf_config("llama")).moe is None


def test_attention_biases_are_read_as_each_family_places_them():
    def biases(kind, **changes):
        config = tiny_hf_config(kind)
        for name, value in changes.items():
            setattr(config, name, value)
        architecture = ModelArchitecture.from_hf_config(config)
        return architecture.qkv_bias, architecture.o_bias

    assert biases("llama") == (False, False) and biases("llama", attention_bias=True) == (True, True)
    assert biases("qwen2") == (True, False) and biases("qwen2_moe") == (True, False)
    assert biases("qwen2_moe", qkv_bias=False) == (False, False)
    assert biases("helium") == (True, False) and biases("seed_oss") == (True, False)
    assert biases("seed_oss", attention_out_bias=True) == (True, True)
    config = tiny_hf_config("mixtral")
    config.num_experts_per_tok = 5
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 4\], got 5"):
        ModelArchitecture.from_hf_config(config)


def test_experts_load_from_transformers_own_stacked_names_and_a_missing_one_is_named(tmp_path):
    # Checkpoints store each expert's matrices (experts.N.w1 ...); transformers' state_dict stacks them
    # (experts.gate_up_proj [E, 2I, H]). Both load to the same model.
    hf_model = write_tiny_model("qwen2_moe", tmp_path)
    runner = ModelRunner(ModelConfig(str(tmp_path), device="cpu", dtype="float32"), CacheConfig(kv_cache_memory=1 << 20))
    stacked = ModelRunner(ModelConfig(str(tmp_path), device="cpu", dtype="float32"), CacheConfig(kv_cache_memory=1 << 20))
    stacked.model.load_weights(hf_model.state_dict().items())
    tokens = [5, 9, 11, 3, 7, 120, 64]
    assert torch.equal(last_logits(runner, tokens), last_logits(stacked, tokens))
    weights = load_file(tmp_path / "model.safetensors")
    extra = {"model.layers.1.mlp.experts.6.up_proj.weight": weights["model.layers.1.mlp.experts.4.up_proj.weight"]}
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.1.mlp.experts.6.up_proj.weight'"):
        runner.model.load_weights((weights | extra).items())  # a seventh expert of six
    del weights["model.layers.1.mlp.experts.4.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weights: \['layers.1.mlp.experts_gate_up\[4\]\[48\]'\]"):
        runner.model.load_weights(weights.items())


@pytest.mark.parametrize("wrapper", ["gemma3", "mistral3", "llava"])
def test_a_vision_language_checkpoint_serves_its_language_model_alone(wrapper, tmp_path):
    # The hub's layout (language_model.model.*, vision_tower.*, multi_modal_projector.*), as transformers saves it:
    # the language model's weights load, the rest is left out, and text-only logits are the wrapper's own.
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, LlavaConfig, LlavaForConditionalGeneration,
                              Mistral3Config, Mistral3ForConditionalGeneration)

    text = tiny_hf_config({"gemma3": "gemma3", "mistral3": "mistral", "llava": "llama"}[wrapper]).to_dict()
    if wrapper == "gemma3":
        config = Gemma3Config(text_config=text, mm_tokens_per_image=4, image_token_index=158, boi_token_index=156,
                              eoi_token_index=157, vision_config=dict(hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
        model = Gemma3ForConditionalGeneration(config)
    elif wrapper == "mistral3":
        config = Mistral3Config(text_config=text, image_token_index=158, spatial_merge_size=1,
                                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, head_dim=16, image_size=28, patch_size=14))
        model = Mistral3ForConditionalGeneration(config)
    else:
        config = LlavaConfig(text_config=text, image_token_index=158, vision_config=dict(
            model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32))
        model = LlavaForConditionalGeneration(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1, 0.5)
    model.eval().save_pretrained(tmp_path)
    runner = ModelRunner(ModelConfig(str(tmp_path), device="cpu", dtype="float32"),
                         CacheConfig(kv_cache_memory=1 << 20))
    assert runner.config.vision_language_wrapper == wrapper
    assert bool(runner.config.layer_windows) == (wrapper != "llava")  # the text model's
    tokens = [(7 * i) % 150 for i in range(60)]  # past the window, no image tokens
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    assert (last_logits(runner, tokens) - expected).abs().max().item() < 1e-4


def test_unknown_architecture_is_refused(tmp_path):
    write_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelRunner(ModelConfig(str(tmp_path), device="cpu"), CacheConfig(kv_cache_memory=1 << 20))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_model_dir(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_dir(str(tmp_path))
    write_tiny_model("llama", tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        ModelRunner(ModelConfig(str(tmp_path / "m"), device="cpu"), CacheConfig(kv_cache_memory=1 << 20))


def test_a_missing_or_misshapen_weight_is_named(tmp_path):
    write_tiny_model("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights.*layers.1.self_attn.qkv_proj"):
        ModelRunner(ModelConfig(str(tmp_path), device="cpu"), CacheConfig(kv_cache_memory=1 << 20))
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="k_proj.weight.*shape"):
        ModelRunner(ModelConfig(str(tmp_path), device="cpu"), CacheConfig(kv_cache_memory=1 << 20))


def test_bad_dtype_and_budget_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="dtype 'float8'"):
        parse_dtype("float8")
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(ModelConfig(str(tiny_llama_dir), dtype="int8", device="cpu"), CacheConfig(kv_cache_memory=1 << 20))
    with pytest.raises(ValueError, match="kv_cache_memory"):
        ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu"), CacheConfig(kv_cache_memory=10))


def test_context_length_is_capped_at_what_the_kv_cache_holds(tiny_llama_dir):
    runner = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu"),
                         CacheConfig(block_size=16, kv_cache_memory=1 << 16))
    assert runner.max_model_len == runner.num_blocks * 16 < runner.config.max_model_len


@pytest.mark.slow
def test_a_gguf_path_is_converted_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    shutil.copy(default_model_gguf(), gguf)
    converted = resolve_model_dir(str(gguf))
    assert (converted / "config.json").is_file() and safetensors_files(converted)
    assert resolve_model_dir(str(gguf)) == converted  # cached: no second conversion
    elsewhere = tmp_path / "reinstalled" / "model.gguf"  # the same file at another path and time
    elsewhere.parent.mkdir()
    shutil.copy(gguf, elsewhere)
    assert resolve_model_dir(str(elsewhere)) == converted
    runner = ModelRunner(ModelConfig(str(gguf), device="cpu"), CacheConfig(kv_cache_memory=64 << 20))
    assert runner.config.model_type == "llama" and runner.config.tie_word_embeddings


def test_a_gguf_file_is_named_by_its_content_not_its_path_or_time(tmp_path):
    data = bytes(range(256)) * (3 << 12)  # 3 MiB: a head, a middle and a tail
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(data)
    second.write_bytes(data)
    os.utime(second, (0, 0))
    assert _gguf_key(first) == _gguf_key(second)
    second.write_bytes(data[:-1] + b"x")  # a changed tensor at the end
    assert _gguf_key(first) != _gguf_key(second)
    second.write_bytes(data + b"x")  # a longer file
    assert _gguf_key(first) != _gguf_key(second)
