"""OpenAI's API takes null for any optional parameter, meaning its default (several client libraries send it
for every parameter they leave unset); a null where a value is required is a 400 naming the field."""
from __future__ import annotations

import json

import pytest
from frontend.http_server import APIError, ChatRequest, CompletionRequest, parse_body
from tests.support.http_app import http_app


def parse(model, body: dict):
    return parse_body(model, json.dumps(body).encode())


SAMPLING_DEFAULTS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "min_tokens": 0,
                     "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
                     "stop_token_ids": [], "ignore_eos": False, "stream": False, "skip_special_tokens": True,
                     "include_stop_str_in_output": False}


@pytest.mark.parametrize("model,base,own_defaults", [
    (CompletionRequest, {"prompt": "hi"}, {"echo": False}),
    (ChatRequest, {"messages": [{"role": "user", "content": "hi"}]}, {"logprobs": False}),
])
def test_a_null_optional_parameter_takes_its_default(model, base, own_defaults):
    defaults = SAMPLING_DEFAULTS | own_defaults
    parsed = parse(model, base | dict.fromkeys(defaults))
    assert {name: getattr(parsed, name) for name in defaults} == defaults
    # The same as leaving them out.
    assert parsed == parse(model, base)


def test_a_field_whose_type_takes_none_keeps_the_null():
    # max_tokens null: to the end of the context (the chat API's default; the completions API's is 16).
    assert parse(CompletionRequest, {"prompt": "hi"}).max_tokens == 16
    assert parse(CompletionRequest, {"prompt": "hi", "max_tokens": None}).max_tokens is None
    chat = parse(ChatRequest, {"messages": [{"role": "user", "content": None, "name": None}], "seed": None,
                               "stop": None, "response_format": {"type": "json_schema", "json_schema": {
                                   "name": None, "schema": {"type": "object"}, "strict": None}}})
    assert chat.messages[0].content is None and chat.seed is None and chat.stop is None
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


@pytest.mark.parametrize("model,body,param,where", [
    (CompletionRequest, {"prompt": None}, "prompt", "prompt"),
    (ChatRequest, {"messages": None}, "messages", "messages"),
    (ChatRequest, {"messages": [{"role": None, "content": "hi"}]}, "messages", "messages.0.role"),
    (ChatRequest, {"messages": [{"role": "user", "content": "hi"}],
                   "response_format": {"type": "json_schema", "json_schema": {"schema": None}}},
     "response_format", "response_format.json_schema.schema"),
])
def test_a_null_required_field_is_refused_naming_it(model, body, param, where):
    with pytest.raises(APIError) as refused:
        parse(model, body)
    assert refused.value.status == 400 and refused.value.param == param
    assert str(refused.value).startswith(f"{where}: ")


def test_the_api_answers_a_null_where_a_value_is_required_with_a_400():
    response = http_app().post("/v1/completions", json={"prompt": None, "temperature": None})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                  {"type": "input_audio"}, "just a string"])
def test_a_content_part_other_than_text_is_refused_by_its_type(part):
    # Not pydantic's "Input should be a valid string", which left a client to guess what was wrong.
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]}
    with pytest.raises(APIError) as caught:
        parse(ChatRequest, body)
    kind = part.get("type") if isinstance(part, dict) else None
    assert (caught.value.status, caught.value.param) == (400, "messages")
    assert str(caught.value) == (f"messages.0.content: part 1 is of type {kind!r}: this model takes text "
                                  "only (parts of type 'text')")
    parsed = parse(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}]}]})
    assert parsed.messages[0].content[0].text == "Look:"
