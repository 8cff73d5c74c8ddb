"""bench/kernel.py's part 2 on the CPU: the random checkpoint it writes loads, the floor's byte count, and
the decode loop through ModelRunner.execute (the GPU run itself is tools/gpu_check.sh's)."""
from __future__ import annotations

import pytest
import torch

from bench import kernel
from executor_svc.model_runner import ModelRunner
from pagedserve.config import CacheConfig, ModelConfig

TINY = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=50, max_position_embeddings=256, rms_norm_eps=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_random_checkpoint_loads_and_floor_counts_every_weight_once(tmp_path, tied):
    params = kernel.write_random_qwen2(tmp_path, {**TINY, "tie_word_embeddings": tied}, device="cpu")
    runner = ModelRunner(ModelConfig(str(tmp_path), dtype="bfloat16", device="cpu"),
                         CacheConfig(block_size=16, kv_cache_memory=1 << 20))
    assert runner.config.model_type == "qwen2" and runner.config.qkv_bias and runner.config.head_dim == 64
    assert params == runner.model.weight_numel()
    weight, kv = kernel.decode_floor_bytes(runner, [100, 28])
    embedding = 50 * 128 * 2
    assert weight == 2 * params - (0 if tied else embedding)
    assert kv == 128 * 2 * 2 * 1 * 64 * 2  # positions x layers x (K, V) x KV heads x head_dim x bf16
    bias = runner.model.layers[0].self_attn.qkv_proj.bias
    assert bias.abs().max() > 0 and bias.abs().max() < 0.2


def test_decode_loop_through_the_runner(tmp_path):
    kernel.write_random_qwen2(tmp_path, {**TINY, "tie_word_embeddings": True}, device="cpu")
    row = kernel.bench_e2e(str(tmp_path), copy_bps=1e9, enforce_eager=False, batch=3, context=30, warmup=2, steps=3,
                           device="cpu", dtype="float32")
    assert row["mode"] == "cuda-graphs" and row["attention_backend"] != "cupy" and row["graph_replays"] == 0
    assert row["contexts"] == [33, 35] and row["steps"] == 3
    assert row["kv_bytes"] == 3 * 34 * 2 * 2 * 1 * 64 * 4
    assert row["floor_ms"] == pytest.approx((row["weight_bytes"] + row["kv_bytes"]) / 1e9 * 1e3)
    assert row["vs_floor"] == pytest.approx(row["floor_ms"] / row["step_ms"])
    assert row["tokens_per_s"] == pytest.approx(3 / (row["step_ms"] / 1e3))
