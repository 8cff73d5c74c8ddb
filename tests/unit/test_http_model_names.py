"""The names the HTTP API serves the model under: the model's own by default, several when given, and 404
model_not_found for any other, before anything reaches the back end."""
from __future__ import annotations

import pytest

from pagedserve.config import DEFAULT_MODEL_NAME, ServingConfig, model_name
from tests.support.http_app import http_app


@pytest.fixture
def http():
    return http_app(("smollm", "org/alias"))


def test_every_served_name_is_listed_and_accepted(http):
    cards = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in cards] == ["smollm", "org/alias"]
    for card in cards:  # OpenAI's retrieve, by each name
        assert http.get(f"/v1/models/{card['id']}").json() == card
    for name in ("smollm", "org/alias", None):
        response = http.post("/tokenize", json={"prompt": "hi", **({"model": name} if name else {})})
        assert response.status_code == 200 and response.json()["tokens"] == [104, 105]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                       ("/tokenize", {"prompt": "hi"})])
def test_any_other_name_is_not_found(http, path, body):
    for response in (http.post(path, json={"model": "default", **body}), http.get("/v1/models/org/default")):
        assert response.status_code == 404
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("not_found_error", "model", "model_not_found")
        assert "'smollm', 'org/alias'" in error["message"]


def test_the_default_name_is_the_models_own(tmp_path):
    assert model_name("default") == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    (tmp_path / "Qwen2-0.5B").mkdir()
    assert model_name(str(tmp_path / "Qwen2-0.5B") + "/") == "Qwen2-0.5B"
    assert model_name("models/tinyllama.Q4_0.gguf") == "tinyllama.Q4_0"


def test_served_names_are_not_empty():
    assert ServingConfig(served_model_name=("a", "b")).served_model_name == ("a", "b")
    with pytest.raises(ValueError, match="^served_model_name"):
        ServingConfig(served_model_name=("a", " "))
