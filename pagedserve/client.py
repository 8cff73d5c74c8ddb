"""A small client of the public Generate API."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pagedserve.convert import FINISH_REASON_NAMES
from pagedserve.service import client_channel
from pagedserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

SAMPLING_FIELDS = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0


def build_request(prompt=None, *, prompt_token_ids=None, messages=None, request_id: str = "",
                  cache_salt: str = "", priority: int = 0, add_generation_prompt: bool | None = None,
                  continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                  tools: list[dict] | None = None, add_special_tokens: bool | None = None,
                  **sampling) -> generate_pb2.GenerateRequest:
    """A Generate request; the chat options and tools apply to messages (generate.proto's ChatMessages), each
    message a dict of ChatMessage's fields. add_special_tokens None: the server's default for the input."""
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling fields: {sorted(unknown)}")
    request = generate_pb2.GenerateRequest(request_id=request_id, cache_salt=cache_salt, priority=priority)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    if prompt is not None:
        request.prompt = prompt
    if prompt_token_ids is not None:
        request.prompt_token_ids.ids[:] = prompt_token_ids
    if messages is not None:
        for message in messages:
            fields = {key: value for key, value in message.items() if key != "tool_calls" and value is not None}
            added = request.messages.messages.add(**fields)
            if message.get("tool_calls"):
                added.tool_calls.extend(message["tool_calls"])
        if add_generation_prompt is not None:
            request.messages.add_generation_prompt = add_generation_prompt
        request.messages.continue_final_message = continue_final_message
        if chat_template_kwargs is not None:
            request.messages.chat_template_kwargs.update(chat_template_kwargs)
        if tools is not None:
            request.messages.tools.extend(tools)
    elif add_generation_prompt is not None or continue_final_message or chat_template_kwargs is not None or tools:
        raise TypeError("add_generation_prompt, continue_final_message, chat_template_kwargs and tools apply to "
                        "messages")
    for name, value in sampling.items():
        if value is None:
            continue
        if isinstance(value, list):
            getattr(request.sampling, name)[:] = value
        elif isinstance(value, dict):  # logit_bias
            getattr(request.sampling, name).update(value)
        else:
            setattr(request.sampling, name, value)
    return request


class GenerateClient:
    """api_key: sent as `authorization: Bearer`; tls_ca: verify a TLS server with this CA file; tls_cert and
    tls_key: the client certificate for mutual TLS."""

    def __init__(self, address: str, *, api_key: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None) -> None:
        self.channel = client_channel(address, api_key=api_key, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self.generation = generate_pb2_grpc.GenerationStub(self.channel)

    def stream(self, request: generate_pb2.GenerateRequest, timeout: float | None = None) -> Iterator[generate_pb2.GenerateResponse]:
        return self.generation.Generate(request, timeout=timeout)

    def generate(self, request: generate_pb2.GenerateRequest, timeout: float | None = None) -> Completion:
        completion = Completion()
        for response in self.stream(request, timeout=timeout):
            completion.request_id = response.request_id
            completion.token_ids.extend(response.token_ids)
            completion.text += response.text
            if response.finish_reason:
                completion.finish_reason = FINISH_REASON_NAMES[response.finish_reason]
                completion.prompt_tokens = response.usage.prompt_tokens
        return completion

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GenerateClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
