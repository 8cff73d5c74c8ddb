"""OpenAI tool calls on the chat API, as vLLM makes them. A request that names a function (tool_choice
{"type": "function", ...}) or asks for at least one call ("required") is decoded under a JSON schema, so that
whatever the model, its output is a call that parses: the named function's arguments, or a list of
{"name", "parameters"} objects over the tools offered. "auto" (the model choosing between text and calls, OpenAI's
default when tools are given) reads the calls from the model's own syntax with a parser the server is started
with (`--enable-auto-tool-choice --tool-call-parser hermes`), and is refused without one."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

# A function without a parameters schema takes any object, as OpenAI's API reads it.
ANY_OBJECT = {"type": "object"}


class ToolError(ValueError):
    """A tools or tool_choice value that cannot apply; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ToolCalls:
    """How a request's output becomes tool calls. function: the one named by tool_choice, else None (required)."""

    schema: str  # the JSON schema the output is decoded under
    function: str | None
    skip_special_tokens = True

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def calls(self, text: str) -> list[dict] | None:
        """The output's calls, OpenAI's {"id", "type", "function": {"name", "arguments"}}; None where a list of
        calls did not come whole (cut short by max_tokens or a stop string), and is then returned as text."""
        if self.function is not None:
            return [tool_call(self.function, text)]
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(parsed, list) or not all(isinstance(c, dict) and {"name", "parameters"} <= c.keys()
                                                   for c in parsed):
            return None
        return [tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in parsed]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The choice's message and finish reason: a list of calls finishes "tool_calls" rather than "stop", as
        vLLM's do; the named function's call finishes as its text would."""
        calls = self.calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        if self.function is None and finish_reason == "stop":
            finish_reason = "tool_calls"
        return {"role": "assistant", "content": None, "tool_calls": calls}, finish_reason


class ToolCallStream:
    """A streamed answer's deltas: the named function's arguments as they come (the call's id, type and name with
    the first), or a list of calls whole with its choice's last chunk (it parses only whole)."""

    def __init__(self, plan: ToolCalls) -> None:
        self.plan = plan
        self.texts: dict[int, str] = {}  # a list of calls so far, by choice

    def delta(self, index: int, text: str, first: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        delta: dict = {"role": "assistant"} if first else {}
        if self.plan.function is not None:
            call = tool_call(self.plan.function, text) if first else {"function": {"arguments": text}}
            delta["tool_calls"] = [{"index": 0, **call}]
            return delta, finish_reason
        self.texts[index] = self.texts.get(index, "") + text
        if finish_reason is None:
            return delta, None
        return _final_delta(delta, *self.plan.message(self.texts.pop(index), finish_reason))


def _final_delta(delta: dict, message: dict, finish_reason: str | None) -> tuple[dict, str | None]:
    """A choice's last delta, carrying what was held back: its calls whole, or else its text."""
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    if message.get("content"):
        delta["content"] = message["content"]
    return delta, finish_reason


class HermesToolCalls:
    """tool_choice "auto" for models that write a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    (Hermes, Qwen2.5, Qwen3): the text before the first call is the message's content, the calls follow. Output
    that does not parse as calls comes back whole as text: nothing the model wrote is dropped."""

    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
    schema = None  # decoded freely: the model chooses
    skip_special_tokens = False  # the call markers are special tokens in some vocabularies

    def calls(self, text: str) -> list[dict] | None:
        """The calls in the text, None where it holds none or they do not parse."""
        if self.START not in text:
            return None
        calls = []
        for match in self.CALL.finditer(text):
            try:
                parsed = json.loads(match.group(1))
            except json.JSONDecodeError:
                return None
            if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
                return None
            arguments = parsed.get("arguments", {})
            calls.append(tool_call(parsed["name"], arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)))
        return calls

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        calls = self.calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        content = text[: text.index(self.START)].strip()
        message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def stream(self) -> "HermesToolCallStream":
        return HermesToolCallStream(self)


class HermesToolCallStream:
    """Text streams as it comes until a call may be starting (a tail that could begin <tool_call> is held back);
    from the first call on, the rest is held and comes with the choice's last chunk, as calls where it parses,
    else as the text it is."""

    def __init__(self, plan: HermesToolCalls) -> None:
        self.plan = plan
        self.held: dict[int, str] = {}  # by choice: text not yet sent
        self.in_call: set[int] = set()

    def delta(self, index: int, text: str, first: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        delta: dict = {"role": "assistant"} if first else {}
        held = self.held.pop(index, "") + text
        if finish_reason is not None:
            self.in_call.discard(index)
            start = held.find(self.plan.START)
            if start >= 0:
                message, call_finish = self.plan.message(held[start:], finish_reason)
                if "tool_calls" in message:
                    if start:
                        delta["content"] = held[:start]
                    return _final_delta(delta, message, call_finish)
            if held:  # no calls after all: the held text, as it was
                delta["content"] = held
            return delta, finish_reason
        if index in self.in_call:
            self.held[index] = held
            return delta, None
        start = held.find(self.plan.START)
        if start >= 0:
            self.in_call.add(index)
            send, self.held[index] = held[:start], held[start:]
        else:
            keep = partial_suffix(held, self.plan.START)
            send, self.held[index] = held[: len(held) - keep], held[len(held) - keep:]
        if send:
            delta["content"] = send
        return delta, None


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (and may go on to be it)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


TOOL_CALL_PARSERS = {"hermes": HermesToolCalls}


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def plan_tool_calls(tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool = True,
                    auto_parser: str | None = None) -> ToolCalls | HermesToolCalls | None:
    """How the request's output becomes tool calls, or None where it is text (no tools, or tool_choice "none").
    auto_parser: the server's parser for "auto" (TOOL_CALL_PARSERS), None where "auto" is refused. Raises
    ToolError naming the field at fault."""
    functions = function_schemas(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return None
    if not functions:
        raise ToolError("tool_choice", f"tool_choice {json.dumps(tool_choice)} needs tools")
    if tool_choice == "auto":
        if auto_parser is not None:
            return TOOL_CALL_PARSERS[auto_parser]()
        raise ToolError("tool_choice", 'tool_choice "auto" needs a parser of the model\'s own tool-call syntax, which '
                        'this server was not started with (--enable-auto-tool-choice --tool-call-parser): set '
                        'tool_choice "required" or name a function ({"type": "function", "function": '
                        '{"name": ...}}), or "none"')
    if tool_choice == "required":
        options = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                     "parameters": parameters},
                    "required": ["name", "parameters"]} for name, parameters in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolCalls(json.dumps(schema), None)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                        '"function": {"name": ...}}')
    if name not in functions:
        raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not among the tools "
                        f"({', '.join(functions)})")
    return ToolCalls(json.dumps(functions[name]), name)


def function_schemas(tools: list) -> dict[str, dict]:
    """name -> parameters schema, checking each tool's shape (ToolError naming tools where one is amiss)."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError("tools", f"tools[{i}].function.name must be a non-empty string")
        if name in functions:
            raise ToolError("tools", f"tools[{i}].function.name {name!r} is given twice")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        functions[name] = parameters or ANY_OBJECT
    return functions
