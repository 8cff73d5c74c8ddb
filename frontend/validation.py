"""Checking a Generate request and turning its prompt into token ids, before it reaches the back end.

Every rejection is a ``ValidationError`` naming the request field at fault, so the gRPC layer can
answer INVALID_ARGUMENT with a message the caller can act on.
"""
from __future__ import annotations

import asyncio
import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

from frontend.tools import ToolError, function_schemas
from pagedserve.chat import ChatOptionError, ChatTemplateRejected, render_chat
from pagedserve.sampling_params import STRUCTURE_FIELDS, SamplingParams

MAX_REQUEST_ID_LEN = 256
CHAT_ROLES = frozenset({"developer", "system", "user", "assistant", "tool"})  # OpenAI's roles


class ValidationError(ValueError):
    def __init__(self, field: str, message: str):
        # SamplingParams's messages already start with the field name; don't say it twice.
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field


@dataclass
class GenerateInput:
    request_id: str
    # Exactly one of these three: plain text, token ids, or chat messages ({"role", "content"}).
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    # How messages are rendered (pagedserve/chat.py).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None  # OpenAI's function definitions, for the template
    # The tokenizer's special tokens (a BOS) added to the text; None: yes for a prompt, no for messages (their
    # template writes its own), as vLLM's completion and chat APIs default.
    add_special_tokens: bool | None = None
    # Sampling and stopping, with SamplingParams's defaults; max_tokens None: up to the context. None for one
    # of MODEL_DEFAULTED: the model's default (its generation config), else SamplingParams'.
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    n: int = 1
    # Not a sampling parameter: it keeps requests apart in the prefix cache.
    cache_salt: str | None = None
    priority: int = 0  # lower runs first under the scheduler's priority policy

    @property
    def structured(self) -> bool:
        """Whether some structured output is asked (SamplingParams.structured, before the checks)."""
        return self.json_object or any(getattr(self, name) is not None for name in STRUCTURE_FIELDS)


# The sampling fields a model's generation config may give defaults for (generation_config_defaults): left
# unset (None) in a GenerateInput, they take the model's.
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def validate_and_tokenize(
    inp: GenerateInput,
    tokenizer: Any,
    max_model_len: int,
    vocab_size: int,
    max_prompt_chars: int | None = None,
    sampling_defaults: dict | None = None,
) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and the request's SamplingParams, or a ValidationError.

    ``max_prompt_chars`` bounds a text prompt (or the messages' contents together) before it is tokenized,
    and prompt_token_ids by the context length, so that an oversized prompt costs nothing.
    ``sampling_defaults`` (generation_config_defaults) fill the fields of MODEL_DEFAULTED the request left unset,
    and their max_tokens caps the request's.
    """
    _check_request_id(inp.request_id)
    _check_frontend_fields(inp)
    _check_prompt_size(inp, max_prompt_chars, None if inp.truncate_prompt_tokens is not None else max_model_len)
    # Cheap checks first: a bad temperature should not cost a chat template and a tokenization.
    params = _sampling_params(inp, vocab_size, sampling_defaults or {})
    if params.bad_words:
        _tokenize_bad_words(params, tokenizer, vocab_size)
    try:
        params.check_allowed_tokens()  # (EOS, which the frontend does not know, is the executor's to check)
    except ValueError as e:
        raise ValidationError("allowed_token_ids", str(e)) from None
    prompt_ids = params.truncated(_prompt_token_ids(inp, tokenizer, vocab_size), max_model_len)
    if len(prompt_ids) >= max_model_len:
        raise ValidationError(
            "prompt", f"prompt is {len(prompt_ids)} tokens, the context holds {max_model_len} "
            "and generation needs at least one more",
        )
    if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_model_len:
        # Rejected rather than silently shortened, as vLLM does.
        raise ValidationError(
            "max_tokens", f"max_tokens ({params.max_tokens}) plus the prompt's {len(prompt_ids)} "
            f"tokens exceeds the context length ({max_model_len})",
        )
    if len(prompt_ids) + params.min_tokens > max_model_len:  # max_tokens unset: the context's room must hold it
        raise ValidationError(
            "min_tokens", f"min_tokens ({params.min_tokens}) plus the prompt's {len(prompt_ids)} tokens exceeds the "
            f"context length ({max_model_len})",
        )
    return prompt_ids, params


# Rendering and tokenizing a long prompt takes up to seconds; off the event loop, everyone else's streams and the
# health checks go on meanwhile. One thread: a tokenizer is not safe to call from several at once (a fast
# tokenizer's first call may reset its truncation settings). Short prompts stay inline: the hop would cost more.
LONG_INPUT_CHARS = 16384
_TOKENIZING = ThreadPoolExecutor(1, thread_name_prefix="tokenize")


async def tokenizing(chars: int, fn, *args, **kwargs):
    """fn(*args, **kwargs), in the tokenizing thread where its input is `chars` characters or more."""
    if chars < LONG_INPUT_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZING, functools.partial(fn, *args, **kwargs))


async def validate_and_tokenize_async(inp: GenerateInput, *args, **kwargs) -> tuple[list[int], SamplingParams]:
    """validate_and_tokenize, in the tokenizing thread where the input is long."""
    return await tokenizing(input_chars(inp), validate_and_tokenize, inp, *args, **kwargs)


def input_chars(inp: GenerateInput) -> int:
    """Characters the input renders: a text prompt's, or the messages' roles and contents (the template renders
    each message's role, so that many empty messages count as well)."""
    if isinstance(inp.prompt, str):
        return len(inp.prompt)
    if isinstance(inp.messages, list):
        return sum(len(m[key]) for m in inp.messages if isinstance(m, dict)
                   for key in ("role", "content") if isinstance(m.get(key), str))
    return 0


def _check_request_id(request_id: object) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValidationError("request_id", "request_id must be a non-empty string")
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise ValidationError(
            "request_id", f"request_id must be at most {MAX_REQUEST_ID_LEN} characters, "
            f"got {len(request_id)}",
        )


def _check_frontend_fields(inp: GenerateInput) -> None:
    if not isinstance(inp.stop_token_ids, list):
        raise ValidationError("stop_token_ids", "stop_token_ids must be a list of token ids")
    if inp.cache_salt is not None and (not isinstance(inp.cache_salt, str) or not inp.cache_salt):
        raise ValidationError("cache_salt", "cache_salt must be a non-empty string when set")
    if isinstance(inp.priority, bool) or not isinstance(inp.priority, int) or not -2**31 <= inp.priority < 2**31:
        raise ValidationError("priority", f"priority must be a 32-bit integer, got {inp.priority!r}")


def _check_prompt_size(inp: GenerateInput, max_prompt_chars: int | None, max_model_len: int | None) -> None:
    """Refuses a prompt too long to tokenize, and prompt_token_ids beyond max_model_len (None: they will be
    truncated)."""
    chars = input_chars(inp)
    if max_prompt_chars is not None and chars > max_prompt_chars:
        if isinstance(inp.prompt, str):
            raise ValidationError("prompt", f"prompt is {chars} characters, at most {max_prompt_chars} are accepted")
        raise ValidationError("messages", f"messages hold {chars} characters, at most {max_prompt_chars} are accepted")
    ids = inp.prompt_token_ids
    if max_model_len is not None and isinstance(ids, list) and len(ids) >= max_model_len:
        raise ValidationError(
            "prompt", f"prompt is {len(ids)} tokens, the context holds {max_model_len} "
            "and generation needs at least one more")


_LEADING_FIELD = re.compile(r"[a-z_]+")
_INPUT_FIELDS = frozenset(f.name for f in fields(GenerateInput))


def _sampling_params(inp: GenerateInput, vocab_size: int, defaults: dict) -> SamplingParams:
    chosen = {name: value for name in MODEL_DEFAULTED if (value := getattr(inp, name)) is not None}
    modelled = {name: value for name, value in defaults.items() if name in MODEL_DEFAULTED}
    max_tokens, cap = inp.max_tokens, defaults.get("max_tokens")
    if cap is not None:
        max_tokens = cap if max_tokens is None else min(max_tokens, cap)
    try:
        params = SamplingParams(
            **{**modelled, **chosen},
            seed=inp.seed, max_tokens=max_tokens, min_tokens=inp.min_tokens,
            stop=inp.stop, stop_token_ids=inp.stop_token_ids, ignore_eos=inp.ignore_eos, logprobs=inp.logprobs,
            prompt_logprobs=inp.prompt_logprobs,
            include_stop_str_in_output=inp.include_stop_str_in_output, skip_special_tokens=inp.skip_special_tokens,
            presence_penalty=inp.presence_penalty, frequency_penalty=inp.frequency_penalty,
            logit_bias=inp.logit_bias, allowed_token_ids=inp.allowed_token_ids, bad_words=inp.bad_words,
            truncate_prompt_tokens=inp.truncate_prompt_tokens,
            json_schema=inp.json_schema,
            json_object=inp.json_object, regex=inp.regex, choice=inp.choice, grammar=inp.grammar, n=inp.n,
        )
        params.check_token_ids(vocab_size)
    except ValueError as e:
        # SamplingParams's messages start with the field name.
        match = _LEADING_FIELD.match(str(e))
        name = match.group() if match and match.group() in _INPUT_FIELDS else "sampling_params"
        raise ValidationError(name, str(e)) from None
    if params.structured:
        _check_grammar(params)
    return params


def _tokenize_bad_words(params: SamplingParams, tokenizer: Any, vocab_size: int) -> None:
    if tokenizer is None:
        raise ValidationError("bad_words", "bad_words need the model's tokenizer, and this model has none")
    params.tokenize_bad_words(tokenizer)
    try:
        params.check_token_ids(vocab_size)
    except ValueError as e:
        raise ValidationError("bad_words", str(e)) from None


def _check_grammar(params: SamplingParams) -> None:
    """Refuses here what the executor's grammar compiler would refuse, so that it fails as a bad request."""
    kind, source = params.grammar_source()
    if kind == "json_schema":
        try:
            json.loads(source)
        except ValueError as e:
            raise ValidationError("json_schema", f"json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise ValidationError("json_schema", "json_schema is nested too deeply") from None
    import xgrammar  # only structured requests pay for the import

    build = {"json_schema": xgrammar.Grammar.from_json_schema, "regex": xgrammar.Grammar.from_regex,
             "ebnf": xgrammar.Grammar.from_ebnf}.get(kind)
    try:
        if build is not None:
            build(source)
    except RuntimeError as e:
        field = ("grammar" if params.grammar is not None else "choice") if kind == "ebnf" else kind
        # (xgrammar starts its messages with the time and its own source line: the client needs neither)
        reason = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(e).strip())
        raise ValidationError(field, f"{field} is not usable: {reason}") from None


def _prompt_token_ids(inp: GenerateInput, tokenizer: Any, vocab_size: int) -> list[int]:
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(inp, name) is not None]
    if len(given) != 1:
        raise ValidationError(
            "prompt", "exactly one of prompt, prompt_token_ids and messages must be set, got "
            + (", ".join(given) if given else "none"),
        )
    if inp.prompt is not None:
        if not isinstance(inp.prompt, str) or not inp.prompt:
            raise ValidationError("prompt", "prompt must be a non-empty string")
        ids = list(tokenizer.encode(inp.prompt, add_special_tokens=inp.add_special_tokens is not False))
    elif inp.prompt_token_ids is not None:
        ids = inp.prompt_token_ids
        if not isinstance(ids, list) or not ids:
            raise ValidationError("prompt_token_ids", "prompt_token_ids must be a non-empty list")
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValidationError(
                    "prompt_token_ids", f"prompt_token_ids must be integers in [0, {vocab_size}), got {token_id!r}"
                )
        ids = list(ids)
    else:
        _check_messages(inp.messages)
        if inp.tools is not None:
            try:
                function_schemas(inp.tools)
            except ToolError as e:
                raise ValidationError("tools", str(e)) from None
        try:
            text = render_chat(tokenizer, inp.messages, inp.add_generation_prompt, inp.continue_final_message,
                               inp.chat_template_kwargs, inp.tools)
        except ChatOptionError as e:
            raise ValidationError(e.field, str(e)) from None
        except ChatTemplateRejected as e:
            raise ValidationError("messages", f"messages rejected by the chat template: {e}") from None
        ids = list(tokenizer.encode(text, add_special_tokens=bool(inp.add_special_tokens)))
    if not ids:
        raise ValidationError("prompt", "prompt tokenizes to no tokens")
    if max(ids) >= vocab_size:
        # A tokenizer larger than the model's embedding (a mismatched --tokenizer) would fail the whole step.
        raise ValidationError(
            "prompt", f"prompt tokenizes to id {max(ids)}, beyond the model's vocabulary ({vocab_size}): the "
            "tokenizer does not match the model")
    return ids


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages", "messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValidationError("messages", f"messages[{i}] must be a dict with role and content")
        if message.get("role") not in CHAT_ROLES:
            raise ValidationError(
                "messages", f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {message.get('role')!r}"
            )
        if not isinstance(message.get("content"), str):
            raise ValidationError("messages", f"messages[{i}].content must be a string")
