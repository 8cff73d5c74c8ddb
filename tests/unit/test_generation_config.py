"""A model's generation config as the default sampling parameters, as vLLM takes it (`--generation-config`): the
fields a request leaves unset take the model's, its max_new_tokens caps max_tokens, `vllm` turns it off."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from frontend.http_server import OpenAIServer
from frontend.validation import GenerateInput, validate_and_tokenize
from pagedserve.config import ModelConfig
from pagedserve.sampling_params import generation_config_defaults

QWEN_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "repetition_penalty": 1.05,
             "temperature": 0.7, "top_k": 20, "top_p": 0.8, "max_new_tokens": 40, "min_p": 0}


def model_dir(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_sampling_fields_are_read_by_sampling_params_names(tmp_path):
    defaults = generation_config_defaults("auto", model_dir(tmp_path, QWEN_LIKE))
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
                        "max_tokens": 40}
    assert type(defaults["min_p"]) is float  # JSON's 0, as the float the field is
    assert generation_config_defaults("vllm", tmp_path) == {}
    assert generation_config_defaults(str(tmp_path), None) == defaults  # a directory named instead
    assert generation_config_defaults("auto", tmp_path / "elsewhere") == {}  # no file: none


@pytest.mark.parametrize("config,named", [({"temperature": -1}, "temperature"), ({"top_k": 1.5}, "top_k"),
                                          ({"max_new_tokens": 0}, "max_tokens")])
def test_a_bad_value_is_refused_naming_the_file_and_the_field(tmp_path, config, named):
    with pytest.raises(ValueError, match=f"generation_config: .*generation_config.json: {named}"):
        generation_config_defaults("auto", model_dir(tmp_path, config))


def test_the_option_takes_auto_vllm_or_a_directory_holding_one(tmp_path):
    assert ModelConfig(generation_config=str(model_dir(tmp_path, QWEN_LIKE))).generation_config == str(tmp_path)
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a directory"):
        ModelConfig(generation_config=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="temperature"):
        ModelConfig(generation_config=str(model_dir(tmp_path, {"temperature": "hot"})))


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, **options):
        return "".join(m["content"] for m in messages)


def params(defaults: dict, **fields):
    return validate_and_tokenize(GenerateInput(request_id="r", prompt="hi", **fields), CharTokenizer(), 1024, 256,
                                 sampling_defaults=defaults)[1]


def test_unset_fields_take_the_models_defaults_and_set_ones_win():
    defaults = {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 40}
    taken = params(defaults, max_tokens=None)
    assert (taken.temperature, taken.top_k, taken.repetition_penalty, taken.top_p, taken.max_tokens) == (
        0.7, 20, 1.05, 1.0, 40)
    own = params(defaults, temperature=0.0, top_k=0, repetition_penalty=1.0, max_tokens=100)
    assert (own.temperature, own.top_k, own.repetition_penalty) == (0.0, 0, 1.0)
    assert own.max_tokens == 40  # max_new_tokens caps the request's own, as vLLM's
    assert params(defaults, max_tokens=8).max_tokens == 8
    plain = params({}, max_tokens=None)
    assert (plain.temperature, plain.top_k, plain.repetition_penalty, plain.max_tokens) == (1.0, 0, 1.0, None)


class RecordingLink:
    draining = False

    def __init__(self) -> None:
        self.params = []

    def submit(self, request_id, prompt_token_ids, params, *args, **kwargs):
        self.params.append(params)
        raise RuntimeError("recorded")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
])
def test_each_http_api_takes_the_defaults_for_what_the_body_leaves_out_or_null(path, body):
    link = RecordingLink()
    app = TestClient(OpenAIServer(link, CharTokenizer(), ("m",), max_model_len=1024, vocab_size=256,
                                  max_prompt_chars=100, sampling_defaults={"temperature": 0.0, "top_p": 0.5,
                                                                           "max_tokens": 5}).app,
                     raise_server_exceptions=False)
    app.post(path, json=body)
    app.post(path, json={**body, "temperature": None, "top_p": None})  # null: the default, as OpenAI's API
    app.post(path, json={**body, "temperature": 1.0, "top_p": 1.0, "max_tokens": 9, "max_output_tokens": 9})
    assert [(p.temperature, p.top_p, p.max_tokens) for p in link.params] == [(0.0, 0.5, 5), (0.0, 0.5, 5),
                                                                            (1.0, 1.0, 5)]


def test_grpc_leaves_unset_what_the_request_does_not_carry():
    from frontend.server import _generate_input
    from pagedserve.v1 import common_pb2, generate_pb2

    bare = _generate_input(generate_pb2.GenerateRequest(prompt="hi"))
    assert (bare.temperature, bare.top_p, bare.top_k, bare.min_p, bare.repetition_penalty) == (None,) * 5
    given = _generate_input(generate_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(
        temperature=1.0, top_k=0, repetition_penalty=1.0)))
    assert (given.temperature, given.top_k, given.repetition_penalty) == (1.0, 0, 1.0)
    assert params({"temperature": 0.0, "top_k": 20}, temperature=given.temperature, top_k=given.top_k).top_k == 0
