"""A model's generation config through the running stack: the frontend reads it from the model's directory, and
both public APIs sample with it where a request leaves the fields unset (here greedy, at most 4 tokens)."""
from __future__ import annotations

import json

import httpx

from pagedserve import LLM, SamplingParams
from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig
from pagedserve.entrypoints.launcher import Stack
from tests.support.tiny_stack import write_tiny_model_with_tokenizer

PROMPT = [5, 6, 7, 8, 9]


def test_both_apis_take_the_models_generation_config_for_what_a_request_leaves_unset(tmp_path):
    model = write_tiny_model_with_tokenizer(tmp_path)
    saved = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**saved, "temperature": 0.0, "max_new_tokens": 4}))
    [greedy] = LLM(str(model), device="cpu", dtype="float32", kv_cache_memory=4 << 20).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    config = PagedServeConfig.from_kwargs(model=str(model), device="cpu", dtype="float32", port=0,
                                          http_address="127.0.0.1:0", kv_cache_memory=4 << 20, log_level="WARNING")
    with Stack(config) as stack:
        with GenerateClient(stack.address) as client:
            answer = client.generate(build_request(prompt_token_ids=PROMPT, ignore_eos=True), timeout=60)
        assert answer.token_ids == greedy.token_ids and len(answer.token_ids) == 4
        body = {"prompt": PROMPT, "ignore_eos": True, "max_tokens": 100}  # the config's 4 caps it
        completion = httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=60).json()
        assert completion["choices"][0]["text"] == greedy.text and completion["usage"]["completion_tokens"] == 4
        body = {"prompt": PROMPT, "ignore_eos": True, "temperature": 1.0}  # its own temperature wins
        sampled = [httpx.post(f"{stack.http_url}/v1/completions", json={**body, "seed": seed}, timeout=60).json()
                   for seed in range(6)]
        assert {s["choices"][0]["text"] for s in sampled} != {greedy.text}
