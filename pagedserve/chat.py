"""A conversation rendered with the model's chat template: the same for the gRPC and OpenAI APIs and the
offline LLM, with vLLM's options (add_generation_prompt, continue_final_message, chat_template_kwargs)."""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any


class ChatOptionError(ValueError):
    """An option that cannot apply; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ChatTemplateRejected(ValueError):
    """The template itself refused the conversation (templates raise what they like)."""


def load_chat_template(value: str) -> str:
    """A chat template given as a file or as the template itself (vLLM's --chat-template takes both)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a chat template: an assistant's tool calls with their arguments as objects, as templates
    iterate them (vLLM does the same); arguments that are not JSON stay text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_with_parsed_arguments(call) for call in calls]}
        out.append(message)
    return out


def _with_parsed_arguments(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function = {**function, "arguments": json.loads(arguments)}
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """The prompt text. add_generation_prompt opens the assistant's turn after the conversation;
    continue_final_message leaves the last message open instead, so that the model carries it on (a prefill of
    the answer); chat_template_kwargs are extra variables for the template (e.g. enable_thinking); tools are
    OpenAI's function definitions, for a template that shows them to the model."""
    if add_generation_prompt and continue_final_message:
        raise ChatOptionError("continue_final_message", "continue_final_message leaves the last message open and "
                              "add_generation_prompt opens a new one: set add_generation_prompt false with it")
    extra = dict(chat_template_kwargs or {})
    if any(not isinstance(key, str) for key in extra):
        raise ChatOptionError("chat_template_kwargs", "chat_template_kwargs must map names to values")
    if extra:  # the template's variables only: the rendering's own arguments are not the client's to set
        own = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
        if taken := sorted(set(extra) & own):
            raise ChatOptionError("chat_template_kwargs", f"chat_template_kwargs cannot set {', '.join(taken)}")
    try:
        return tokenizer.apply_chat_template(template_messages(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False, **extra)
    except Exception as error:  # jinja errors, or a final message with nothing to continue
        raise ChatTemplateRejected(str(error)) from None
