"""The OpenAI-compatible HTTP API, served by the frontend beside its gRPC API and sharing its tokenizer,
validation (frontend/validation.py) and stream to the scheduler (GenerateCall over the SchedulerLink).

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming as server-sent events), GET
/v1/models, GET /health, GET /metrics (Prometheus, frontend/metrics.py), POST /tokenize, POST /detokenize.
Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}; a client that disconnects aborts
its request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import json
import logging
import socket
import threading
import time
import typing
import uuid
from typing import Any, Callable, Literal

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from frontend.generation import DRAINING, AsyncInbox, ChoiceDelta, GenerateCall, GenerateError, with_the_rest
from frontend.metrics import FrontendMetrics
from frontend.reasoning import KEEPS_SPECIAL_TOKENS, ReasoningStream, split_reasoning
from frontend.responses import (ResponseEvents, ResponsesError, ResponseStore, chat_messages, chat_tool_choice,
                                chat_tools, conversation, finished, output_items, text_format)
from frontend.responses import usage as responses_usage
from frontend.tools import ToolError, plan_tool_calls
from frontend.validation import (MODEL_DEFAULTED, GenerateInput, ValidationError, tokenizing,
                                 validate_and_tokenize_async)
from pagedserve.output.detokenizer import token_utf8
from pagedserve.beam_search import MAX_BEAM_WIDTH, BeamSearch
from pagedserve.sampling_params import STRUCTURE_FIELDS, SamplingParams
from pagedserve.step import SampledToken

logger = logging.getLogger(__name__)

# Prompts one completion request may hold (each is a request of its own to the scheduler).
MAX_PROMPTS = 256
# How often a request checks that its client is still connected; what its reader then finds in its inbox.
DISCONNECT_POLL_S = 0.5
DISCONNECTED = object()
CLIENT_CLOSED = 499  # the status of a whole answer that its client left before it was complete (never sent)
# Served without an API key, as vLLM serves them: a load balancer's health check and a Prometheus scrape.
OPEN_PATHS = ("/health", "/metrics")
# Request fields whose name differs on this API from the validation's (GenerateInput's).
HTTP_PARAM = {"json_schema": "response_format", "json_object": "response_format", "request_id": "X-Request-Id",
              "prompt_token_ids": "prompt", "regex": "guided_regex", "choice": "guided_choice",
              "grammar": "guided_grammar"}
# The Responses API's names for the chat path's fields.
RESPONSES_PARAM = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
                   "response_format": "text"}
ERROR_STATUS = {"overloaded": 429, "error": 500, "unavailable": 503}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


async def _watch_disconnect(request: Request, call: GenerateCall) -> None:
    """Aborts the call, and wakes its reader, once the client has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    call.abort()
    call.inbox.queue.put_nowait(DISCONNECTED)


class ApiKeyMiddleware:
    """Refuses a request without a valid `authorization` header (401), but on OPEN_PATHS. Plain ASGI: starlette's
    BaseHTTPMiddleware (@app.middleware) passes every chunk of a streamed response through a stream and a task
    of its own."""

    def __init__(self, app, api_key_ok: Callable[[str], bool]) -> None:
        self.app, self.api_key_ok = app, api_key_ok

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            authorization = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not self.api_key_ok(authorization.decode("latin-1")):
                response = error_response(401, "a valid API key is required: authorization: Bearer <key>",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPE.get(status, "error"), "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


# vLLM's parameters this server does not implement (_Sampling), refused by name when they ask for anything (a
# value other than None, False or empty) rather than ignored as unknown fields are: each would change the
# answer or its shape.
NOT_IMPLEMENTED = ("logits_processors", "prompt_embeds", "chat_template", "documents")
# Beam search (vLLM's use_beam_search) returns whole beams, unconstrained: these ask for what it does not give.
NOT_WITH_BEAM_SEARCH = ("stream", "logprobs", "echo", "prompt_logprobs", "stop", "response_format",
                        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")

# ------------------------------------------------------------------------------------------ request bodies
# Strict: a string where a number belongs is refused, not converted. Unknown fields are ignored, as OpenAI's
# own clients send a few this server has no use for.

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _null_means_the_default(cls, data: Any) -> Any:
        """OpenAI's API takes null for any optional parameter, meaning its default, and several client libraries
        send it for those they leave unset. A field whose own type takes None (max_tokens: to the end of the
        context) keeps it; a required one left null is then reported missing."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or key not in cls._defaulted_on_null()}

    @classmethod
    @functools.cache
    def _defaulted_on_null(cls) -> frozenset[str]:
        """The names (and aliases) of the fields whose type does not take None."""
        return frozenset(name for field_name, field in cls.model_fields.items()
                         if type(None) not in typing.get_args(field.annotation)
                         for name in (field_name, field.alias) if name)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict = pydantic.Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs (its guided_* fields' successor): exactly one kind of structure."""
    json_schema: dict | str | None = pydantic.Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Not implemented: refused when set, rather than ignored. (Free whitespace between JSON tokens is always
    # disabled here, which disable_any_whitespace asks for.)
    structural_tag: str | dict | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False
    disable_any_whitespace: bool = False

    def apply(self, inp: GenerateInput) -> None:
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise APIError(400, f"structured_outputs.{name} is not supported by this server", "structured_outputs")
        if self.disable_additional_properties:
            raise APIError(400, "structured_outputs.disable_additional_properties is not supported by this server",
                           "structured_outputs")
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_schema" if name == "json" else name) not in (None, False)]
        if len(given) != 1:
            raise APIError(400, "structured_outputs takes exactly one of json, regex, choice, grammar and json_object, "
                                f"got {', '.join(given) or 'none'}", "structured_outputs")
        if self.json_schema is not None:
            inp.json_schema = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
        inp.regex, inp.choice, inp.grammar = self.regex, self.choice, self.grammar
        inp.json_object = bool(self.json_object)


class _Sampling(_Body):
    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = {}
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower runs first (ties by arrival)
    # vLLM's: the tokenizer's special tokens (a BOS) added to the text; None: yes for a prompt, no for messages.
    add_special_tokens: bool | None = None
    user: str | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: list[str] = []  # vLLM's: words that must not be generated
    truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last k tokens
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and rank, and the top k there
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name their tokens "token_id:{id}", not by text
    # vLLM's beam search: n beams, ranked by cumulative logprob over length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's parameters that this server does not implement (NOT_IMPLEMENTED).
    logits_processors: list | None = None
    prompt_embeds: str | list | None = None
    chat_template: str | None = None  # a request's own template (the server's is --chat-template)
    documents: list | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None  # only as many as n: this server returns every sequence it samples


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool's answer: to which call
    # An assistant's thinking earlier in the conversation (vLLM's name, and DeepSeek's older one), which some
    # templates show again.
    reasoning: str | None = pydantic.Field(None, validation_alias=pydantic.AliasChoices("reasoning",
                                                                                       "reasoning_content"))

    @pydantic.field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Else an image part is refused as pydantic's "Input should be a valid string" (the union's first arm).
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"part {i} is of type {kind!r}: this model takes text only (parts of type "
                                     "'text')")
        return content


class ChatRequest(_Sampling):
    messages: list[Message]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    functions: list[dict] | None = None  # OpenAI's older form of tools: refused, not ignored
    echo: bool = False  # vLLM's: the last message's content before the answer; refused


class ResponsesRequest(_Body):
    """OpenAI's Responses API: the fields this server acts on (others, such as reasoning or include, are
    ignored, as unknown fields are)."""
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    priority: int = 0
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: dict | None = None
    metadata: dict | None = None
    store: bool | None = None  # OpenAI's default, true, where the server keeps responses
    previous_response_id: str | None = None
    background: bool = False
    user: str | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # as generation's: None is yes for a prompt, no for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first["loc"]]
        where = ".".join(loc)
        # A validator's own message, without pydantic's "Value error, " before it.
        message = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]
        raise APIError(400, f"{where}: {message}" if where else message, loc[0] if loc else None,
                       first["type"]) from None


def _top(tokens: list[SampledToken] | None, num: int) -> list[SampledToken] | None:
    """The tokens with their top logprobs cut to num (the engine computed as many as the largest use asked)."""
    if tokens is None:
        return None
    return [dataclasses.replace(t, top_token_ids=(t.top_token_ids or [])[:num],
                                top_logprobs=(t.top_logprobs or [])[:num]) for t in tokens]


# ------------------------------------------------------------------------------------------ the API

class OpenAIServer:
    def __init__(self, link, tokenizer: Any, served_model_names: tuple[str, ...], max_model_len: int,
                 vocab_size: int, max_prompt_chars: int, api_key_ok: Callable[[str], bool] | None = None,
                 metrics: FrontendMetrics | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, responses_store_size: int = 0,
                 sampling_defaults: dict | None = None) -> None:
        """served_model_names: what requests may name the model (responses name it by the first);
        api_key_ok: checks an `authorization` header's value; None: the API is open; metrics: served on
        /metrics (without, that route is a 404); tool_call_parser: reads the calls of tool_choice "auto" (none:
        "auto" is refused); reasoning_parser: splits a reasoning model's thinking from its answer
        (frontend/reasoning.py); responses_store_size: the Responses API's stored responses (0: none)."""
        self.link, self.tokenizer, self.metrics = link, tokenizer, metrics
        self.model_names, self.model_name = served_model_names, served_model_names[0]
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.max_prompt_chars, self.api_key_ok = max_prompt_chars, api_key_ok
        self.sampling_defaults = sampling_defaults or {}  # the model's (generation_config_defaults)
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.responses_store = ResponseStore(responses_store_size) if responses_store_size else None
        self.created = int(time.time())
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pagedserve", openapi_url=None, docs_url=None, redoc_url=None)

        if self.api_key_ok is not None:
            app.add_middleware(ApiKeyMiddleware, api_key_ok=self.api_key_ok)

        @app.exception_handler(APIError)
        async def api_error(_request, error: APIError):
            return error_response(error.status, str(error), error.param, error.code)

        @app.exception_handler(HTTPException)
        async def http_error(_request, error: HTTPException):
            return error_response(error.status_code, str(error.detail))

        @app.exception_handler(Exception)
        async def unexpected(_request, error: Exception):
            logger.exception("HTTP request failed")
            return error_response(500, f"internal error: {type(error).__name__}")

        app.get("/health")(self.health)
        app.get("/version")(self.version)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model:path}")(self.model)  # (a name may hold slashes: org/model)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/responses")(self.responses)
        app.get("/v1/responses/{response_id}")(self.stored_response)
        app.delete("/v1/responses/{response_id}")(self.delete_response)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        if self.metrics is not None:
            app.get("/metrics")(self.prometheus_metrics)
        return app

    async def health(self) -> Response:
        """503 while the frontend drains, so that a load balancer sends new requests elsewhere."""
        return Response(status_code=503 if self.link.draining else 200)

    @staticmethod
    async def version() -> dict:
        """vLLM's route: the server's version."""
        return {"version": importlib.metadata.version("pagedserve")}

    def prometheus_metrics(self) -> Response:
        """Not async: a scrape reads the scheduler's stats, on a worker thread rather than the API's loop."""
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": self.model_name, "max_model_len": self.max_model_len}

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card(name) for name in self.model_names]}

    async def model(self, model: str) -> dict:
        """OpenAI's retrieve: the card of one served name, else 404 model_not_found."""
        self._check_model(model)
        return self._model_card(model)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", "model",
                           "model_not_found")

    # ---------------------------------------------------------------- tokenize

    async def tokenize(self, request: Request) -> dict:
        body = parse_body(TokenizeRequest, await request.body())
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "exactly one of prompt and messages must be set", "prompt")
        if body.prompt is not None:
            if len(body.prompt) > self.max_prompt_chars:
                raise APIError(400, f"prompt is {len(body.prompt)} characters, at most {self.max_prompt_chars} "
                                    "are accepted", "prompt")
            ids = await tokenizing(len(body.prompt), self.tokenizer.encode, body.prompt,
                                   add_special_tokens=body.add_special_tokens is not False)
        else:
            inp = GenerateInput(request_id="tokenize", messages=_messages(body.messages), max_tokens=None,
                                add_special_tokens=body.add_special_tokens, **_chat_options(body))
            ids = (await self._validate(inp))[0]
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        body = parse_body(DetokenizeRequest, await request.body())
        self._check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"tokens must be in [0, {self.vocab_size}), got {bad[0]}", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    # ---------------------------------------------------------------- generation

    async def _validate(self, inp: GenerateInput, body: _Sampling | None = None) -> tuple[list[int], Any]:
        try:
            return await validate_and_tokenize_async(inp, self.tokenizer, self.max_model_len, self.vocab_size,
                                                     max_prompt_chars=self.max_prompt_chars,
                                                     sampling_defaults=self.sampling_defaults)
        except ValidationError as error:
            param = HTTP_PARAM.get(error.field, error.field)
            if error.field == "json_schema" and body is not None and body.guided_json is not None:
                param = "guided_json"
            if (error.field in STRUCTURE_FIELDS and body is not None
                    and body.structured_outputs is not None):
                param = "structured_outputs"
            message = str(error)  # named by the API's own field where the back end's differs
            raise APIError(400, message if message.startswith(param) else f"{param}: {message}", param) from None

    def _sampling_input(self, body: _Sampling, request: Request) -> GenerateInput:
        self._check_model(body.model)
        for name in NOT_IMPLEMENTED:
            if getattr(body, name) not in (None, False, []):
                raise APIError(400, f"{name} is not supported by this server", name)
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs are not available with stream (as in vLLM)", "prompt_logprobs")
        inp = GenerateInput(request_id=request.headers.get("x-request-id") or uuid.uuid4().hex)
        for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "min_tokens",
                     "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                     "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "priority",
                     "add_special_tokens", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                     "prompt_logprobs"):
            if name in MODEL_DEFAULTED and name not in body.model_fields_set:
                continue  # the model's default, else SamplingParams'
            setattr(inp, name, getattr(body, name))
        inp.stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if body.response_format is not None and body.response_format.type == "json_object":
            inp.json_object = True
        elif body.response_format is not None and body.response_format.type == "json_schema":
            if body.response_format.json_schema is None:
                raise APIError(400, "response_format of type json_schema needs json_schema", "response_format")
            inp.json_schema = json.dumps(body.response_format.json_schema.schema_)
        # vLLM's names for structured output. One kind per request, refused here for a second so that the 400
        # names the HTTP field (SamplingParams would name its own).
        guided = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                    "structured_outputs") if getattr(body, name) is not None]
        if body.response_format is not None and body.response_format.type != "text":
            guided.insert(0, "response_format")
        if len(guided) > 1:
            raise APIError(400, f"{' and '.join(guided)} are exclusive: one structure per request", guided[-1])
        if body.guided_json is not None:
            inp.json_schema = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        inp.regex, inp.choice, inp.grammar = body.guided_regex, body.guided_choice, body.guided_grammar
        if body.structured_outputs is not None:
            body.structured_outputs.apply(inp)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream", "stream_options")
        return inp

    async def completions(self, request: Request):
        """One prompt, or a list of them (strings or token id lists): prompt i's choice j is choice i * n + j,
        and usage adds the prompts up, as OpenAI and vLLM answer a batch."""
        body = parse_body(CompletionRequest, await request.body())
        inp = self._sampling_input(body, request)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"best_of is not supported beyond n ({body.n}): every sampled sequence is returned",
                           "best_of")
        prompt = body.prompt
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        prompts = prompt if batch else [prompt]
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"prompt holds {len(prompts)} prompts, at most {MAX_PROMPTS} are accepted", "prompt")
        # echo with max_tokens 0 (vLLM's way to score a prompt): the prompt and its logprobs, no completion.
        prompt_only = body.echo and body.max_tokens == 0
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo, which scores the prompt alone)",
                           "max_tokens")
        inp.max_tokens, inp.logprobs = 1 if prompt_only else body.max_tokens, body.logprobs
        # The echoed prompt's tokens come with their logprobs; with prompt_logprobs as well, the engine computes
        # the larger number of top logprobs, and each use keeps its own.
        asked = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
        inp.prompt_logprobs = max(asked, default=None)
        parts = []
        for i, one in enumerate(prompts):
            part_input = dataclasses.replace(inp, prompt=one if isinstance(one, str) else None,
                                             prompt_token_ids=None if isinstance(one, str) else one)
            try:
                prompt_ids, params = await self._validate(part_input, body)
            except APIError as error:
                if not batch:
                    raise
                raise APIError(error.status, f"prompt {i}: {error}", error.param, error.code) from None
            whole = isinstance(one, str) and params.truncate_prompt_tokens is None  # else the ids that remain
            echo = (one if whole else self.tokenizer.decode(prompt_ids)) if body.echo else None
            parts.append(_CompletionPart(prompt_ids, params, echo, i * params.n))
        response_id = f"cmpl-{inp.request_id}"
        if body.use_beam_search:
            searches = await asyncio.gather(*(self._beam_search(request, body, inp, part.prompt_ids, part.params)
                                              for part in parts))
            choices = [{"index": part.first_index + index, "text": text, "logprobs": None, "finish_reason": finish}
                       for part, beams in zip(parts, searches) for index, (text, finish, _) in enumerate(beams)]
            return self._json({"id": response_id, "object": "text_completion", "created": int(time.time()),
                               "model": self.model_name, "choices": choices,
                               "usage": _sum_usage([_beam_usage(part.prompt_ids, beams)
                                                    for part, beams in zip(parts, searches)])}, inp.request_id)
        calls = [self._call(part.prompt_ids, part.params, inp, prompt_only) for part in parts]
        if body.stream:
            def chunk(part: _CompletionPart, delta: ChoiceDelta, first: bool) -> dict:
                if delta.prompt_logprobs is not None:
                    part.prompt_logprobs = delta.prompt_logprobs  # choice 0's, echoed by every choice
                echoed = None
                if first and part.echo is not None and body.logprobs is not None:
                    echoed = self._echoed_tokens(part.prompt_ids, part.prompt_logprobs)
                start = part.streamed.get(delta.index, 0)
                out = self._completion_chunk(delta, part.echo if first else None, echoed, part.first_index, start,
                                             body.return_tokens_as_token_ids)
                part.streamed[delta.index] = start + len(out["text"])
                if body.return_token_ids:
                    out.update({"prompt_token_ids": part.prompt_ids} if first else {}, token_ids=delta.token_ids)
                return out

            return self._sse(request, calls, response_id, inp.request_id,
                             [functools.partial(chunk, part) for part in parts], "text_completion", body.stream_options)
        collected = await self._collect(request, calls)
        choices, usages = [], []
        for part, deltas in zip(parts, collected):
            echoed = None
            prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
            if part.echo is not None and body.logprobs is not None:
                echoed = self._echoed_tokens(part.prompt_ids, _top(prompt_logprobs, body.logprobs))
            for index in range(part.params.n):
                mine = [d for d in deltas if d.index == index]
                choice = {"index": part.first_index + index, "text": (part.echo or "") + "".join(d.text for d in mine),
                          "logprobs": None, "finish_reason": mine[-1].finish_reason}
                if body.return_token_ids:
                    choice.update(prompt_token_ids=part.prompt_ids, token_ids=[t for d in mine for t in d.token_ids])
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(
                        part.prompt_ids, prompt_logprobs, body.prompt_logprobs, body.return_tokens_as_token_ids)
                if part.params.logprobs is not None:
                    choice["logprobs"] = self._completion_logprobs(
                        (echoed or []) + [t for d in mine for t in d.logprobs or []],
                        as_ids=body.return_tokens_as_token_ids)
                choices.append(choice)
            usages.append(_usage(deltas))
        return self._json({"id": response_id, "object": "text_completion", "created": int(time.time()),
                           "model": self.model_name, "choices": choices, "usage": _sum_usage(usages)},
                          inp.request_id)

    async def chat_completions(self, request: Request):
        body = parse_body(ChatRequest, await request.body())
        if body.functions:
            raise APIError(400, "functions, OpenAI's older form of tools, are not supported: give tools", "functions")
        if body.echo:
            raise APIError(400, "echo is not supported by this server on chat", "echo")
        inp = self._sampling_input(body, request)
        inp.messages = _messages(body.messages)
        tool_calls = self._plan_tools(inp, body.tools, body.tool_choice, body.parallel_tool_calls)
        for name, value in _chat_options(body).items():
            setattr(inp, name, value)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        inp.max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        if body.logprobs:
            inp.logprobs = body.top_logprobs or 0
        reasoning = self._reasoning_parser(inp)
        try:
            prompt_ids, params = await self._validate(inp, body)
        except APIError as error:
            if error.param == "logprobs":  # the chat API's count of alternatives is its top_logprobs
                message = str(error)
                raise APIError(400, "top_" + message if message.startswith("logprobs") else message, "top_logprobs",
                               error.code) from None
            if error.param == "response_format" and tool_calls is not None:  # the schema is the tools'
                raise APIError(400, f"tools: the functions' parameters are not a usable JSON schema: {error}",
                               "tools") from None
            raise
        response_id = f"chatcmpl-{inp.request_id}"
        if body.use_beam_search:
            beams = await self._beam_search(request, body, inp, prompt_ids, params)
            choices = []
            for index, (text, finish, _) in enumerate(beams):
                message, finish_reason = _answer(text, finish, tool_calls, reasoning)
                choices.append({"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason})
            return self._json({"id": response_id, "object": "chat.completion", "created": int(time.time()),
                               "model": self.model_name, "choices": choices,
                               "usage": _beam_usage(prompt_ids, beams)}, inp.request_id)
        call = self._call(prompt_ids, params, inp)
        if body.stream:
            chunk = functools.partial(self._chat_chunk,
                                      tool_calls=None if tool_calls is None else tool_calls.stream(),
                                      reasoning=None if reasoning is None else ReasoningStream(reasoning),
                                      token_ids=body.return_token_ids, as_ids=body.return_tokens_as_token_ids)
            return self._sse(request, [call], response_id, inp.request_id, [chunk], "chat.completion.chunk",
                             body.stream_options, {"prompt_token_ids": prompt_ids} if body.return_token_ids else None)
        [deltas] = await self._collect(request, [call])
        choices = []
        for index in range(params.n):
            mine = [d for d in deltas if d.index == index]
            message, finish_reason = _answer("".join(d.text for d in mine), mine[-1].finish_reason, tool_calls,
                                             reasoning)
            choices.append({
                "index": index, "message": message,
                "logprobs": ({"content": self._chat_logprobs([t for d in mine for t in d.logprobs or []],
                                                             body.return_tokens_as_token_ids)}
                             if params.logprobs is not None else None),
                "finish_reason": finish_reason,
            } | ({"token_ids": [t for d in mine for t in d.token_ids]} if body.return_token_ids else {}))
        answer = {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                  "model": self.model_name, "choices": choices, "usage": _usage(deltas)}
        if body.return_token_ids:
            answer["prompt_token_ids"] = prompt_ids
        if body.prompt_logprobs is not None:
            answer["prompt_logprobs"] = self._prompt_logprobs(
                prompt_ids, next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None), body.prompt_logprobs,
                body.return_tokens_as_token_ids)
        return self._json(answer, inp.request_id)

    async def _beam_search(self, request: Request, body: _Sampling, inp: GenerateInput, prompt_ids: list[int],
                           params: Any) -> list[tuple[str, str, int]]:
        """vLLM's beam search over the engine (pagedserve/beam_search.py): the n best beams' (text, finish
        reason, tokens), best first. Each step sends every live beam as a one-token request; their shared prefix
        comes from the prefix cache."""
        asked = [name for name in NOT_WITH_BEAM_SEARCH if getattr(body, name, None) not in (None, False, [])]
        if body.response_format is not None and body.response_format.type == "text":
            asked = [name for name in asked if name != "response_format"]
        if asked:
            raise APIError(400, f"{asked[0]} is not available with use_beam_search", asked[0])
        if inp.structured:  # what is left: the schema of tool_choice "required" or a named function
            raise APIError(400, "tool_choice that forces a call is not available with use_beam_search", "tool_choice")
        if not 1 <= params.n <= MAX_BEAM_WIDTH:
            raise APIError(400, f"n (the beam width) must be in [1, {MAX_BEAM_WIDTH}] with use_beam_search", "n")
        search = BeamSearch(len(prompt_ids), params.n, params.max_tokens or self.max_model_len - len(prompt_ids),
                            self.tokenizer.eos_token_id, body.length_penalty, params.ignore_eos)
        step = search.step_params(params.temperature)
        while not search.done:
            results = await self._collect(request, [self._call(prompt_ids + beam.tokens, step, inp)
                                                    for beam in search.live])
            search.advance_sampled([next(t for d in deltas for t in d.logprobs or []) for deltas in results])
        return [(self.tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens),
                 "stop" if beam.finished else "length", len(beam.tokens)) for beam in search.best()]

    def _reasoning_parser(self, inp: GenerateInput) -> str | None:
        """The parser that splits the thinking from the answer, where the output is free: structured output
        constrains it from its first token, which leaves no room to think."""
        if inp.structured or self.reasoning_parser is None:
            return None
        if self.reasoning_parser in KEEPS_SPECIAL_TOKENS:
            inp.skip_special_tokens = False  # the parser reads the tags
        return self.reasoning_parser

    def _plan_tools(self, inp: GenerateInput, tools: list[dict] | None, tool_choice: str | dict | None,
                    parallel_tool_calls: bool):
        """How the output becomes tool calls (frontend/tools.py), or None: the tools go to the template, and the
        plan's schema (a named function's, or "required"'s list of calls) to the structured output."""
        try:
            plan = plan_tool_calls(tools, tool_choice, parallel_tool_calls, self.tool_call_parser)
        except ToolError as error:
            raise APIError(400, str(error), error.field) from None
        inp.tools = tools
        if plan is not None and plan.schema is not None:
            if inp.structured:
                raise APIError(400, "tool calls are decoded under their own schema: give no other structured output "
                                    "with tool_choice", "tool_choice")
            inp.json_schema = plan.schema
        if plan is not None and not plan.skip_special_tokens:
            inp.skip_special_tokens = False  # the parser reads the call markers
        return plan

    # ---------------------------------------------------------------- the Responses API

    async def responses(self, request: Request):
        """OpenAI's Responses API on the chat path (frontend/responses.py), whole or as its stream of events."""
        body = parse_body(ResponsesRequest, await request.body())
        self._check_model(body.model)
        if body.background:
            raise APIError(400, "background is not supported: a response runs within its request", "background")
        store = self.responses_store is not None and body.store is not False
        earlier = self._previous_conversation(body.previous_response_id)
        inp = GenerateInput(request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
                            max_tokens=body.max_output_tokens, seed=body.seed, priority=body.priority,
                            **{name: getattr(body, name) for name in ("temperature", "top_p")
                               if name in body.model_fields_set})
        try:
            own = earlier + chat_messages(body.input, None)
            inp.messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + own
            inp.json_schema, inp.json_object = text_format(body.text)
            tools = chat_tools(body.tools)
            tool_choice = chat_tool_choice(body.tool_choice)
        except ResponsesError as error:
            raise APIError(400, str(error), error.field) from None
        plan = self._plan_tools(inp, tools, tool_choice, body.parallel_tool_calls)
        reasoning = self._reasoning_parser(inp)
        try:
            prompt_ids, params = await self._validate(inp)
        except APIError as error:  # named by this API's fields
            param = RESPONSES_PARAM.get(error.param, error.param)
            if param == "text" and plan is not None and plan.schema is not None:
                param = "tools"
            message = str(error).removeprefix(f"{error.param}: ")
            raise APIError(400, message if message.startswith(param) else f"{param}: {message}", param) from None
        # A fresh id, not the client's X-Request-Id (reusable once its request ends): the store is keyed by it.
        response = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                    "status": "in_progress", "model": self.model_name, "output": [], "usage": None, "error": None,
                    "incomplete_details": None, "instructions": body.instructions,
                    "max_output_tokens": body.max_output_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                    "parallel_tool_calls": body.parallel_tool_calls, "text": body.text or {"format": {"type": "text"}},
                    "store": store, "metadata": body.metadata or {},
                    "previous_response_id": body.previous_response_id}
        call = self._call(prompt_ids, params, inp)
        kept = own if store else None
        if body.stream:
            return StreamingResponse(self._response_events(request, call, response, plan, reasoning, kept),
                                     media_type="text/event-stream", headers={"X-Request-Id": inp.request_id})
        [deltas] = await self._collect(request, [call])
        message, finish_reason = _answer("".join(d.text for d in deltas), deltas[-1].finish_reason, plan, reasoning)
        counts = _usage(deltas)
        done = finished(response, output_items(message, finish_reason), finish_reason,
                        responses_usage(counts["prompt_tokens"], counts["completion_tokens"]))
        self._store_response(done, kept)
        return self._json(done, inp.request_id)

    def _previous_conversation(self, response_id: str | None) -> list[dict]:
        """The conversation a previous_response_id continues (none without one)."""
        if response_id is None:
            return []
        if self.responses_store is None:
            raise APIError(400, "previous_response_id is not supported: this server keeps no responses "
                                "(--responses-store-size 0)", "previous_response_id")
        stored = self.responses_store.get(response_id)
        if stored is None:
            raise APIError(404, f"previous response {response_id!r} is not stored on this frontend (not made here, "
                                "stored false, deleted, or gone to make room)", "previous_response_id")
        return stored[1]

    def _store_response(self, done: dict, messages: list[dict] | None) -> None:
        if messages is not None:
            self.responses_store.put(done, conversation(messages, done["output"]))

    async def stored_response(self, response_id: str) -> JSONResponse:
        stored = self.responses_store.get(response_id) if self.responses_store is not None else None
        if stored is None:
            raise APIError(404, f"response {response_id!r} is not stored on this frontend", "response_id")
        return JSONResponse(stored[0])

    async def delete_response(self, response_id: str) -> JSONResponse:
        if self.responses_store is None or not self.responses_store.delete(response_id):
            raise APIError(404, f"response {response_id!r} is not stored on this frontend", "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _response_events(self, request: Request, call: GenerateCall, response: dict, plan,
                               reasoning: str | None, kept: list[dict] | None):
        """The answer as the Responses API's events, from the chat chunks it would stream; stored at its end
        (kept: its conversation so far) where the request stores it."""
        events = ResponseEvents(response)
        chunk = functools.partial(self._chat_chunk, tool_calls=None if plan is None else plan.stream(),
                                  reasoning=None if reasoning is None else ReasoningStream(reasoning))
        prompt_tokens = completion_tokens = 0
        finish_reason = None

        def encode(batch: list[dict]) -> str:
            return "".join(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n" for event in batch)

        yield encode(events.start())
        first = True
        try:
            async for _, delta in self._merged_deltas(request, [call]):
                choice = chunk(delta, first)
                first, finish_reason = False, choice["finish_reason"]
                if delta.usage is not None:
                    prompt_tokens, completion_tokens = delta.usage.prompt_tokens, delta.usage.completion_tokens
                yield encode(events.delta(choice["delta"]))
        except APIError as error:
            yield encode(events.failed(error.code or "server_error", str(error)))
            return
        batch = events.finish(finish_reason, responses_usage(prompt_tokens, completion_tokens))
        self._store_response(batch[-1]["response"], kept)
        yield encode(batch)

    def _call(self, prompt_ids, params, inp: GenerateInput, prompt_only: bool = False) -> GenerateCall:
        # Refused here, before a stream's 200 goes out; the link refuses one that slips past (as an error event).
        if self.link.draining:
            raise APIError(503, DRAINING)
        return GenerateCall(self.link, self.tokenizer, prompt_ids, params, inp.cache_salt, AsyncInbox(),
                            priority=inp.priority, metrics=self.metrics, prompt_only=prompt_only)

    @staticmethod
    def _json(body: dict, request_id: str) -> JSONResponse:
        return JSONResponse(body, headers={"X-Request-Id": request_id})

    async def _deltas(self, request: Request, call: GenerateCall):
        """The call's deltas as they come; aborts the call when the client disconnects. A watcher looks every
        DISCONNECT_POLL_S: a timeout on each wait for an output would cost a timer (wait_for: a task) per token."""
        watcher = asyncio.ensure_future(_watch_disconnect(request, call))
        try:
            call.start()
            while not call.finished:
                for output in with_the_rest(await call.inbox.queue.get(), call.inbox.queue):
                    if output is DISCONNECTED:
                        return
                    yield call.process(output)
        except GenerateError as error:
            raise APIError(ERROR_STATUS[error.kind], str(error)) from None
        except Exception as error:  # this server's fault: a stream then ends with an error event, not in silence
            logger.exception("generation failed")
            raise APIError(500, f"internal error: {type(error).__name__}") from None
        finally:
            watcher.cancel()
            call.close()

    async def _collect(self, request: Request, calls: list[GenerateCall]) -> list[list[ChoiceDelta]]:
        """Each call's deltas, the calls run side by side; one that fails stops the others (their calls are
        aborted) and its error is raised. A client gone before the end gets no answer (nginx's 499)."""
        async def collect(call: GenerateCall) -> list[ChoiceDelta]:
            deltas = [delta async for delta in self._deltas(request, call)]
            if not call.finished:
                raise APIError(CLIENT_CLOSED, "the client disconnected before the answer was complete")
            return deltas

        if len(calls) == 1:
            return [await collect(calls[0])]
        tasks = [asyncio.ensure_future(collect(call)) for call in calls]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _merged_deltas(self, request: Request, calls: list[GenerateCall]):
        """(position of the call, delta) as each call's deltas come; as _collect, a failing call stops the rest."""
        if len(calls) == 1:
            async for delta in self._deltas(request, calls[0]):
                yield 0, delta
            return
        arrivals: asyncio.Queue = asyncio.Queue()

        async def pump(position: int, call: GenerateCall) -> None:
            try:
                async for delta in self._deltas(request, call):
                    arrivals.put_nowait((position, delta))
                arrivals.put_nowait((position, None))
            except APIError as error:
                arrivals.put_nowait((position, error))

        tasks = [asyncio.ensure_future(pump(position, call)) for position, call in enumerate(calls)]
        try:
            running = len(calls)
            while running:
                position, item = await arrivals.get()
                if item is None:
                    running -= 1
                elif isinstance(item, APIError):
                    raise item
                else:
                    yield position, item
        finally:
            for task in tasks:
                task.cancel()

    def _sse(self, request: Request, calls: list[GenerateCall], response_id: str, request_id: str, chunks: list,
             obj: str, options: StreamOptions | None, first_fields: dict | None = None) -> StreamingResponse:
        """Streams the calls' deltas as server-sent events, chunks[i](delta, first) making call i's; the first
        event also carries first_fields."""
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options.continuous_usage_stats
        # Every event is this head, its choices and (with include_usage) its usage: only those are encoded per
        # event, the same JSON as encoding the whole object.
        head = json.dumps({"id": response_id, "object": obj, "created": int(time.time()), "model": self.model_name})
        head = f"data: {head[:-1]}, \"choices\": "

        def frame(choices: list[dict], usage: dict | None = None, fields: dict | None = None) -> str:
            tail = f", \"usage\": {json.dumps(usage)}}}\n\n" if include_usage else "}\n\n"
            return head + json.dumps(choices) + (", " + json.dumps(fields)[1:-1] if fields else "") + tail

        async def events():
            generated: dict[tuple[int, int], int] = {}  # completion tokens so far, by (call, choice)
            deltas: list[list[ChoiceDelta]] = [[] for _ in calls]
            try:
                async for position, delta in self._merged_deltas(request, calls):
                    deltas[position].append(delta)
                    choice = (position, delta.index)
                    first = choice not in generated
                    generated[choice] = generated.get(choice, 0) + len(delta.token_ids)
                    usage = None
                    if continuous_usage:
                        prompt = len(calls[position].prompt_ids)
                        usage = {"prompt_tokens": prompt, "completion_tokens": generated[choice],
                                 "total_tokens": prompt + generated[choice]}
                    yield frame([chunks[position](delta, first)], usage, first_fields if len(generated) == 1 and first
                                else None)
            except APIError as error:
                body = {"error": {"message": str(error), "type": ERROR_TYPE.get(error.status, "error"),
                                  "param": error.param, "code": error.code}}
                yield f"data: {json.dumps(body)}\n\n"
            else:
                if include_usage:
                    yield frame([], _sum_usage([_usage(mine) for mine in deltas]))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Request-Id": request_id})

    def _completion_chunk(self, delta: ChoiceDelta, echo: str | None, echoed: list[SampledToken] | None,
                          first_index: int, text_offset: int, as_ids: bool = False) -> dict:
        tokens = (echoed or []) + (delta.logprobs or [])
        return {"index": first_index + delta.index, "text": (echo or "") + delta.text,
                "logprobs": self._completion_logprobs(tokens, text_offset, as_ids) if tokens else None,
                "finish_reason": delta.finish_reason}

    @staticmethod
    def _echoed_tokens(prompt_ids: list[int], prompt_logprobs: list[SampledToken] | None) -> list[SampledToken]:
        """The prompt's tokens with their logprobs, as OpenAI echoes them: the first one has none."""
        if len(prompt_ids) > 1 and (prompt_logprobs is None or len(prompt_logprobs) != len(prompt_ids) - 1):
            raise APIError(500, "the prompt's logprobs did not come back from the back end")
        return [SampledToken(prompt_ids[0])] + (prompt_logprobs or [])

    def _chat_chunk(self, delta: ChoiceDelta, first: bool, tool_calls=None,
                    reasoning: ReasoningStream | None = None, token_ids: bool = False, as_ids: bool = False) -> dict:
        """tool_calls: the stream of the request's tool-call plan (frontend/tools.py), which shapes the deltas;
        reasoning: splits the thinking off first (the answer after it goes on to tool_calls); token_ids: the
        delta's token ids go with it (return_token_ids); as_ids: logprobs name tokens by id."""
        text, thought = delta.text, ""
        if reasoning is not None:
            thought, text = reasoning.feed(delta.index, text, delta.finish_reason is not None)
        if tool_calls is not None:
            message, finish_reason = tool_calls.delta(delta.index, text, first, delta.finish_reason)
        else:
            message = {"role": "assistant"} if first else {}
            if text or not thought:
                message["content"] = text
            finish_reason = delta.finish_reason
        if thought:
            message["reasoning"] = thought
        return {"index": delta.index, "delta": message,
                "logprobs": {"content": self._chat_logprobs(delta.logprobs, as_ids)} if delta.logprobs else None,
                "finish_reason": finish_reason} | ({"token_ids": delta.token_ids} if token_ids else {})

    def _token_text(self, token_id: int, as_id: bool = False) -> str:
        """A logprob's token as its text, or with as_id (return_tokens_as_token_ids) as vLLM names it by id."""
        return f"token_id:{token_id}" if as_id else self.tokenizer.decode([token_id])

    def _completion_logprobs(self, tokens, text_offset: int = 0, as_ids: bool = False) -> dict:
        """OpenAI's logprobs of a completion, text_offset (where the choice's text so far ends) its first offset."""
        texts = [self._token_text(t.token_id, as_ids) for t in tokens]
        offsets, at = [], text_offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts, "token_logprobs": [t.logprob for t in tokens], "text_offset": offsets,
            # None for an echoed prompt's first token, which has no logprob.
            "top_logprobs": [None if t.logprob is None else
                             {self._token_text(i, as_ids): lp for i, lp in zip(t.top_token_ids, t.top_logprobs)}
                             for t in tokens],
        }

    def _prompt_logprobs(self, prompt_ids: list[int], tokens: list[SampledToken] | None, num: int,
                         as_ids: bool = False) -> list:
        """vLLM's prompt_logprobs: None for the first token, then per position {token id: {logprob, rank,
        decoded_token}} of the prompt's token there and the num most likely."""
        def entry(logprob: float, rank: int | None, token_id: int) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": self._token_text(token_id, as_ids)}

        out: list = [None]
        for t in self._echoed_tokens(prompt_ids, tokens)[1:]:
            ranked = {str(i): entry(lp, rank, i) for rank, (i, lp) in
                      enumerate(zip(t.top_token_ids[:num], t.top_logprobs[:num]), start=1)}
            out.append({str(t.token_id): entry(t.logprob, t.rank, t.token_id), **ranked})
        return out

    def _chat_logprobs(self, tokens, as_ids: bool = False) -> list[dict]:
        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id, as_ids)
            # A part of a character: its own bytes, not U+FFFD's.
            data = None if as_ids else token_utf8(self.tokenizer, token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode() if data is None else data)}

        return [{**entry(t.token_id, t.logprob),
                 "top_logprobs": [entry(i, lp) for i, lp in zip(t.top_token_ids, t.top_logprobs)]}
                for t in tokens]


def _messages(messages: list[Message]) -> list[dict]:
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out.append({"role": message.role, "content": content or ""})
        for name in ("name", "tool_calls", "tool_call_id"):
            if getattr(message, name) is not None:
                out[-1][name] = getattr(message, name)
        if message.reasoning is not None:  # (templates read it as reasoning_content)
            out[-1]["reasoning_content"] = message.reasoning
    return out


def _answer(text: str, finish_reason: str | None, tool_calls, reasoning: str | None) -> tuple[dict, str | None]:
    """A whole answer as the assistant's message, and its finish reason: the thinking split off by the reasoning
    parser (as `reasoning`), the rest read for the tool-call plan's calls (frontend/tools.py)."""
    thought = None
    if reasoning is not None:
        thought, text = split_reasoning(reasoning, text)
    message = {"role": "assistant", "content": text}
    if tool_calls is not None:
        message, finish_reason = tool_calls.message(text, finish_reason)
    if reasoning is not None:
        message["reasoning"] = thought
    return message, finish_reason


def _chat_options(body: ChatRequest | TokenizeRequest) -> dict:
    """How the request's messages are rendered (GenerateInput's fields of the same names)."""
    return {"add_generation_prompt": body.add_generation_prompt, "continue_final_message": body.continue_final_message,
            "chat_template_kwargs": body.chat_template_kwargs}


@dataclasses.dataclass
class _CompletionPart:
    """One prompt of a completion request: its choices are first_index to first_index + n - 1."""

    prompt_ids: list[int]
    params: SamplingParams
    echo: str | None  # the prompt's text, with echo
    first_index: int
    prompt_logprobs: list[SampledToken] | None = None  # choice 0's, as they come (echo while streaming)
    # While streaming: the characters each choice has sent so far, where its next chunk's text_offset starts.
    streamed: dict[int, int] = dataclasses.field(default_factory=dict)


def _sum_usage(usages: list[dict]) -> dict:
    return {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _beam_usage(prompt_ids: list[int], beams: list[tuple[str, str, int]]) -> dict:
    completion = sum(num_tokens for _, _, num_tokens in beams)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _usage(deltas: list[ChoiceDelta]) -> dict:
    """Over every choice: the prompt counted once, the completion tokens of all choices."""
    finished = [d.usage for d in deltas if d.usage is not None]
    prompt = finished[0].prompt_tokens if finished else 0
    completion = sum(u.completion_tokens for u in finished)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class HttpServer:
    """Serves the app with uvicorn on a thread of its own, beside the gRPC server. With tls_cert and tls_key
    it serves HTTPS only, as the gRPC port serves TLS only; with tls_client_ca it requires client
    certificates signed by it."""

    def __init__(self, app: FastAPI, address: str, log_level: str, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_client_ca: str | None = None) -> None:
        import ssl

        import uvicorn

        host, port = address.rsplit(":", 1)
        # Bound here, so that a taken port fails the frontend's start with a clear error.
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host.strip("[]"), int(port)))
        tls = {}
        if tls_cert is not None:
            tls = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key}
            if tls_client_ca is not None:
                tls.update(ssl_ca_certs=tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level.lower(), access_log=False,
                                                    timeout_graceful_shutdown=2, **tls))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="http", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
