"""Fixtures of the modules that drive the HTTP and gRPC APIs of one running stack: the default model in
float32 (so that outputs compare with transformers' float32 references) under its own name, one stack per
module. And, for the modules that start stacks of their own on the tiny model and compare them with a
fault-free run: `model` and `reference`."""
from __future__ import annotations

import pytest

from pagedserve.config import DEFAULT_MODEL_NAME

MODEL = DEFAULT_MODEL_NAME  # what the HTTP API serves the default model as, unless told otherwise


@pytest.fixture(scope="module")
def api_stack():
    from pagedserve.config import PagedServeConfig
    from pagedserve.entrypoints.launcher import Stack

    config = PagedServeConfig.from_kwargs(model="default", device="cpu", dtype="float32", port=0,
                                          kv_cache_memory=256 << 20, log_level="WARNING",
                                          enable_auto_tool_choice=True, tool_call_parser="hermes",
                                          reasoning_parser="qwen3")
    with Stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def openai_client(api_stack):
    import openai

    return openai.OpenAI(base_url=f"{api_stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(api_stack):
    from pagedserve.client import GenerateClient

    with GenerateClient(api_stack.address) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


@pytest.fixture(scope="module")
def hf_model():
    """The default model in transformers, float32: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from executor_svc.model_loader import resolve_model_dir

    return AutoModelForCausalLM.from_pretrained(resolve_model_dir("default"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(tiny_model_with_tokenizer) -> str:
    """The tiny random Llama with a tokenizer (tests/conftest.py)."""
    return str(tiny_model_with_tokenizer)


@pytest.fixture(scope="module")
def reference(model):
    """The offline LLM on `model`: what a fault-free run gives."""
    from pagedserve import LLM

    return LLM(model, device="cpu", kv_cache_memory=64 << 20)
