"""The OpenAI API's app on its own, for what it decides before anything reaches the back end (the model's
names, request bodies): a tokenizer of one id per character, and a link that must never be reached."""
from __future__ import annotations

from fastapi.testclient import TestClient

from frontend.http_server import OpenAIServer


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


class NoLink:
    def submit(self, *args, **kwargs):
        raise AssertionError("a request that should have been refused reached the scheduler")


def http_app(names: tuple[str, ...] = ("smollm",)) -> TestClient:
    return TestClient(OpenAIServer(NoLink(), CharTokenizer(), names, max_model_len=64, vocab_size=256,
                                   max_prompt_chars=100).app)
