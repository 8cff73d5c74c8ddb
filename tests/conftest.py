"""Shared fixtures: tiny random-weight checkpoints written by transformers, and the default model."""
from __future__ import annotations

import pytest
import torch


def tiny_hf_config(kind: str, vocab_size: int = 160, max_position_embeddings: int = 512):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        eos_token_id=vocab_size - 1, bos_token_id=0,
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
    if kind == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    raise ValueError(kind)


def write_tiny_model(kind: str, path, seed: int = 0, **config_overrides):
    """Saves a random-weight transformers model (biases randomised too) and returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, **config_overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # zero at init: randomise so a dropped bias shows
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_model("llama", path)
    return path


class RedisServer:
    """A redis-server of the test's own on a free loopback port, without persistence."""

    def __init__(self, tmp_path) -> None:
        import shutil
        import socket
        import subprocess
        import time

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (make test installs it: apt-get install redis-server)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        import redis

        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    pytest.fail("redis-server did not start")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()
