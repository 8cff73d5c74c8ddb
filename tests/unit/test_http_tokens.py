"""Tokens on the HTTP API. Which prompts get the tokenizer's special tokens, as vLLM's: a completion's text yes
(a base model expects its BOS), a chat's rendered messages no (the template writes its own); add_special_tokens
turns either way, and /tokenize counts as generation tokenizes. And the bytes of each token in chat logprobs."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from frontend.http_server import OpenAIServer

BOS = 1


class BosCharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BOS] * add_special_tokens + [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != BOS or not skip_special_tokens)

    def apply_chat_template(self, messages, **options) -> str:
        return "".join(m["content"] for m in messages)


class RecordingLink:
    """Keeps each submitted prompt and fails the request: only the prompt is under test."""

    draining = False

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def submit(self, request_id, prompt_token_ids, *args, **kwargs):
        self.prompts.append(list(prompt_token_ids))
        raise RuntimeError("recorded")


@pytest.mark.parametrize("path,body,expected", [
    ("/v1/completions", {"prompt": "ab"}, [BOS, 97, 98]),
    ("/v1/completions", {"prompt": "ab", "add_special_tokens": False}, [97, 98]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}]}, [97, 98]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "add_special_tokens": True},
     [BOS, 97, 98]),
])
def test_generation_and_tokenize_add_special_tokens_as_vllm(path, body, expected):
    link = RecordingLink()
    app = TestClient(OpenAIServer(link, BosCharTokenizer(), ("m",), max_model_len=64, vocab_size=256,
                                  max_prompt_chars=100).app, raise_server_exceptions=False)
    app.post(path, json={"max_tokens": 1, **body})
    assert link.prompts == [expected]
    options = {key: value for key, value in body.items() if key != "max_tokens"}
    assert app.post("/tokenize", json=options).json()["tokens"] == expected


def test_chat_logprobs_give_each_tokens_own_bytes_where_it_holds_part_of_a_character():
    """OpenAI's `bytes`: a byte-level token that is part of a character (an emoji's) carries its bytes, which
    joined rebuild the character, where its decoded text alone is a replacement character."""
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir
    from pagedserve.step import SampledToken
    from tests.support.http_app import NoLink

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("default"))
    server = OpenAIServer(NoLink(), tokenizer, ("m",), max_model_len=64, vocab_size=len(tokenizer),
                          max_prompt_chars=100)
    ids = tokenizer.encode("🐶", add_special_tokens=False)
    assert len(ids) > 1  # the emoji spans tokens
    entries = server._chat_logprobs([SampledToken(i, -1.0, [i], [-1.0]) for i in ids])
    assert "\ufffd" in entries[0]["token"]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "🐶"
    assert [e["top_logprobs"][0]["bytes"] for e in entries] == [e["bytes"] for e in entries]
