"""OpenAI tool calls on the chat API, as vLLM makes them. A request that names a function (tool_choice
{"type": "function", ...}) or asks for at least one call ("required") is decoded under a JSON schema, so that
whatever the model, its output is a call that parses: the named function's arguments, or a list of
{"name", "parameters"} objects over the tools offered. "auto" (the model choosing between text and calls, OpenAI's
default when tools are given) reads the calls from the model's own syntax with a parser the server is started
with (`--enable-auto-tool-choice --tool-call-parser hermes`, or mistral, llama3_json, granite, pythonic), and is
refused without one."""
from __future__ import annotations

import abc
import ast
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


class MarkedToolCalls(abc.ABC):
    """tool_choice "auto" for models that mark their calls in their own syntax: the text before the first call is
    the message's content, the calls follow. Output that does not parse as calls comes back whole as text:
    nothing the model wrote is dropped. Subclasses name the markers a call begins with and parse the calls."""

    markers: tuple[str, ...] = ()
    at_output_start = False  # calls only where the output opens with a marker (the whole output is calls)
    schema = None  # decoded freely: the model chooses
    skip_special_tokens = False  # the call markers are special tokens in some vocabularies

    @abc.abstractmethod
    def parse(self, text: str) -> list[dict] | None:
        """The calls in text, which begins with a marker; None where they do not parse."""

    def start(self, text: str, output_start: bool = True) -> int:
        """Where the first call begins in text, -1 where none does; output_start: text opens the output."""
        if self.at_output_start:
            rest = text.lstrip()
            opens = output_start and any(rest.startswith(marker) for marker in self.markers)
            return len(text) - len(rest) if opens else -1
        found = [i for i in (text.find(marker) for marker in self.markers) if i >= 0]
        return min(found, default=-1)

    def undecided(self, text: str, output_start: bool) -> int:
        """How much of text's end may yet begin a call (held back from the stream until it is known)."""
        if self.at_output_start:
            rest = text.lstrip()
            return len(text) if output_start and any(marker.startswith(rest) for marker in self.markers) else 0
        return max(partial_suffix(text, marker) for marker in self.markers)

    def calls(self, text: str) -> list[dict] | None:
        """The calls in the text, None where it holds none or they do not parse."""
        start = self.start(text)
        return None if start < 0 else self.parse(text[start:])

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        calls = self.calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        content = text[: self.start(text)].strip()
        message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def stream(self) -> "MarkedToolCallStream":
        return MarkedToolCallStream(self)


class HermesToolCalls(MarkedToolCalls):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, one per call (Hermes, Qwen2.5, Qwen3)."""

    markers = ("<tool_call>",)
    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[dict] | None:
        return _calls([_json(match.group(1)) for match in self.CALL.finditer(text)], ("arguments",))


class MistralToolCalls(MarkedToolCalls):
    """[TOOL_CALLS] then a JSON list of {"name", "arguments"} (Mistral 7B v0.3, Nemo, Small 3), or, from
    tokenizer v11 on, [TOOL_CALLS]name[ARGS]{...} for each call (Mistral Small 3.2, Magistral, Devstral)."""

    markers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> list[dict] | None:
        body = text.removeprefix("[TOOL_CALLS]").strip()
        if body.startswith("["):
            listed = _json(body)
            return _calls(listed if isinstance(listed, list) else [None], ("arguments",))
        calls = []
        for part in text.split("[TOOL_CALLS]")[1:]:
            name, marked, arguments = part.partition("[ARGS]")
            calls.append({"name": name.strip(), "arguments": _json(arguments)} if marked else None)
        return _calls(calls, ("arguments",))


class Llama3JsonToolCalls(MarkedToolCalls):
    """Llama 3.1-3.3's JSON calls: the output is {"name": ..., "parameters": {...}}, calls separated by ";",
    after an optional <|python_tag|>."""

    markers = ("<|python_tag|>", "{")
    at_output_start = True

    def parse(self, text: str) -> list[dict] | None:
        body, decoder, objects, at = text.strip().removeprefix("<|python_tag|>").strip(), json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                parsed, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return None
            objects.append(parsed)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return _calls(objects, ("parameters", "arguments"))


class GraniteToolCalls(MarkedToolCalls):
    """<|tool_call|> then a JSON list of {"name", "arguments"} (Granite 3)."""

    markers = ("<|tool_call|>",)

    def parse(self, text: str) -> list[dict] | None:
        listed = _json(text.removeprefix("<|tool_call|>"))
        return _calls(listed if isinstance(listed, list) else [None], ("arguments",))


class PythonicToolCalls(MarkedToolCalls):
    """The output is a Python list of calls with keyword arguments, [get_weather(city="Oslo"), get_time()]
    (Llama 3.2 and 4, and others prompted so): arguments are Python literals."""

    markers = ("[",)
    at_output_start = True

    def parse(self, text: str) -> list[dict] | None:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not all(
                    isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute)) and not c.args
                    for c in tree.elts):
                return None
            calls = [{"name": ast.unparse(c.func), "arguments": {k.arg: ast.literal_eval(k.value) for k in c.keywords}}
                     for c in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # not Python, or not literals
            return None
        if any(None in call["arguments"] for call in calls):
            return None
        return _calls(calls, ("arguments",))


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _calls(objects: list, argument_keys: tuple[str, ...]) -> list[dict] | None:
    """OpenAI's calls from {"name": ..., <an argument key>: {...}} objects, None where one is not such an object
    (arguments as a JSON string are passed on as they are; none given are {})."""
    calls = []
    for parsed in objects:
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not parsed["name"]:
            return None
        arguments = next((parsed[key] for key in argument_keys if key in parsed), {})
        if not isinstance(arguments, (dict, str)):  # OpenAI's arguments are an object (or its JSON text)
            return None
        try:
            encoded = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        except (TypeError, ValueError):  # a Python literal JSON cannot hold (a set, bytes, a complex number)
            return None
        calls.append(tool_call(parsed["name"], encoded))
    return calls or None


class MarkedToolCallStream:
    """Text streams as it comes until a call may be starting (a tail that could begin a marker is held back);
    from the first call on, the rest is held and comes with the choice's last chunk, as calls where it parses,
    else as the text it is."""

    def __init__(self, plan: MarkedToolCalls) -> None:
        self.plan = plan
        self.held: dict[int, str] = {}  # by choice: text not yet sent
        self.in_call: set[int] = set()
        self.sent: set[int] = set()  # choices that have sent text (a call can no longer open their output)

    def delta(self, index: int, text: str, first: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        delta: dict = {"role": "assistant"} if first else {}
        held = self.held.pop(index, "") + text
        output_start = index not in self.sent
        if finish_reason is not None:
            start = 0 if index in self.in_call else self.plan.start(held, output_start)  # held opens with the call
            self.in_call.discard(index)
            self.sent.discard(index)
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
        start = self.plan.start(held, output_start)
        if start >= 0:
            self.in_call.add(index)
            send, self.held[index] = held[:start], held[start:]
        else:
            keep = self.plan.undecided(held, output_start)
            send, self.held[index] = held[: len(held) - keep], held[len(held) - keep:]
        if send:
            delta["content"] = send
            self.sent.add(index)
        return delta, None


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (and may go on to be it)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


TOOL_CALL_PARSERS = {"hermes": HermesToolCalls, "mistral": MistralToolCalls, "llama3_json": Llama3JsonToolCalls,
                     "granite": GraniteToolCalls, "pythonic": PythonicToolCalls}


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def plan_tool_calls(tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool = True,
                    auto_parser: str | None = None) -> ToolCalls | MarkedToolCalls | None:
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
