"""OpenAI's Responses API (/v1/responses) on the chat path: the input items become chat messages (instructions a
system message first; function calls and their outputs an assistant's tool_calls and tool messages), function
tools and tool_choice the chat API's, and the answer's text and calls become output items, whole or as the API's
typed stream of events. Responses are stored (ResponseStore) unless a request says store false: a follow-up
naming one as previous_response_id continues its conversation, its input and output before the new input (its
instructions are not carried over, as OpenAI's are not)."""
from __future__ import annotations

import json
import uuid
from collections import OrderedDict


class ResponsesError(ValueError):
    """A request value that cannot apply; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def chat_messages(input_: str | list, instructions: str | None) -> list[dict]:
    """The conversation the input items make, in the chat API's messages."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input_, str):
        return messages + [{"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise ResponsesError("input", "input must be a string or a non-empty list of items")
    for i, item in enumerate(input_):
        if not isinstance(item, dict):
            raise ResponsesError("input", f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if not isinstance(call["id"], str) or not isinstance(call["function"]["name"], str):
                raise ResponsesError("input", f"input[{i}], a function_call, needs call_id and name")
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)  # its text and parallel calls: one turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise ResponsesError("input", f"input[{i}], a function_call_output, needs call_id and output text")
            messages.append({"role": "tool", "content": output, "tool_call_id": item["call_id"]})
        else:
            raise ResponsesError("input", f"input[{i}] is of type {kind!r}: this server takes message, "
                                          "function_call and function_call_output items")
    return messages


def _text(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise ResponsesError("input", f"input[{i}].content must be text, or a list of input_text / output_text parts")


def chat_tools(tools: list | None) -> list[dict] | None:
    """The Responses API's function tools ({"type": "function", "name", "parameters", ...}) as the chat API's."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ResponsesError("tools", f"tools[{i}] is of type {kind!r}: this server runs no tools itself, it "
                                          "takes function tools")
        out.append({"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                                     if tool.get(key) is not None}})
    return out


def chat_tool_choice(tool_choice: str | dict | None) -> str | dict | None:
    """{"type": "function", "name": ...} as the chat API's {"type": "function", "function": {"name": ...}}."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and "name" in tool_choice:
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    return tool_choice


def text_format(text: dict | None) -> tuple[str | None, bool]:
    """(the JSON schema, JSON of any shape) that the request's text.format asks the output to follow."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, False
    if kind == "json_object":
        return None, True
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return json.dumps(fmt["schema"]), False
    raise ResponsesError("text", 'text.format must be {"type": "text"}, {"type": "json_object"} or '
                                 '{"type": "json_schema", "name": ..., "schema": {...}}')


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict, finish_reason: str | None) -> list[dict]:
    """A chat message ({"reasoning", "content", "tool_calls"}) as the response's output items: its thinking, its
    text, then its calls; the last one incomplete where the length cut the answer short."""
    items = []
    if message.get("reasoning"):
        items.append(_reasoning_item(new_id("rs"), message["reasoning"], "completed"))
    if message.get("content"):
        items.append(_message_item(new_id("msg"), message["content"], "completed"))
    items.extend(_call_item(call, "completed") for call in message.get("tool_calls") or [])
    if items and finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def _closed_status(item: dict, output: list[dict], finish_reason: str | None) -> str:
    """An item's status once the answer ends: the last one was cut short where the length ended it."""
    return "incomplete" if finish_reason == "length" and item["id"] == output[-1]["id"] else "completed"


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def _call_item(call: dict, status: str) -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"].get("arguments", ""), "status": status}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def finished(response: dict, output: list[dict], finish_reason: str | None, usage_: dict) -> dict:
    """The response, done: incomplete where max_output_tokens (or the context) cut it short."""
    incomplete = finish_reason == "length"
    return {**response, "status": "incomplete" if incomplete else "completed", "output": output, "usage": usage_,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None}


class ResponseEvents:
    """The typed events of a streamed response, from the chat deltas of its answer (text as it comes, tool calls
    as frontend/tools.py streams them): an output item opens when its text or call begins and closes at the end."""

    def __init__(self, response: dict) -> None:
        self.response = response  # in progress, without output
        self.sequence = 0
        self.output: list[dict] = []
        self.text_item: dict | None = None
        self.text = ""
        self.reasoning_item: dict | None = None
        self.reasoning = ""
        self.calls: dict[int, dict] = {}  # the chat stream's call index -> its output item

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def delta(self, chat_delta: dict) -> list[dict]:
        events = []
        if chat_delta.get("reasoning"):
            if self.reasoning_item is None:
                self.reasoning_item = _reasoning_item(new_id("rs"), "", "in_progress")
                events += self._added(self.reasoning_item)
            self.reasoning += chat_delta["reasoning"]
            events.append(self._event("response.reasoning_text.delta", item_id=self.reasoning_item["id"],
                                      output_index=self._index(self.reasoning_item), content_index=0,
                                      delta=chat_delta["reasoning"]))
        if chat_delta.get("content"):
            if self.text_item is None:
                self.text_item = _message_item(new_id("msg"), "", "in_progress")
                events += self._added(self.text_item)
                events.append(self._event("response.content_part.added", item_id=self.text_item["id"],
                                          output_index=self._index(self.text_item), content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": []}))
            self.text += chat_delta["content"]
            events.append(self._event("response.output_text.delta", item_id=self.text_item["id"],
                                      output_index=self._index(self.text_item), content_index=0,
                                      delta=chat_delta["content"], logprobs=[]))
        for call in chat_delta.get("tool_calls", []):
            item = self.calls.get(call["index"])
            if item is None:
                item = self.calls[call["index"]] = _call_item({**call, "function": {**call["function"],
                                                                                     "arguments": ""}}, "in_progress")
                events += self._added(item)
            arguments = call["function"].get("arguments") or ""
            if arguments:
                item["arguments"] += arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self._index(item), delta=arguments))
        return events

    def finish(self, finish_reason: str | None, usage_: dict) -> list[dict]:
        events = []
        if self.reasoning_item is not None:
            index = self._index(self.reasoning_item)
            events.append(self._event("response.reasoning_text.done", item_id=self.reasoning_item["id"],
                                      output_index=index, content_index=0, text=self.reasoning))
            self.output[index] = _reasoning_item(self.reasoning_item["id"], self.reasoning,
                                                 _closed_status(self.reasoning_item, self.output, finish_reason))
            events.append(self._event("response.output_item.done", output_index=index, item=self.output[index]))
        if self.text_item is not None:
            index, part = self._index(self.text_item), {"type": "output_text", "text": self.text, "annotations": []}
            events.append(self._event("response.output_text.done", item_id=self.text_item["id"], output_index=index,
                                      content_index=0, text=self.text, logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=self.text_item["id"],
                                      output_index=index, content_index=0, part=part))
            self.output[index] = _message_item(self.text_item["id"], self.text,
                                               _closed_status(self.text_item, self.output, finish_reason))
            events.append(self._event("response.output_item.done", output_index=index, item=self.output[index]))
        for item in self.calls.values():
            item["status"] = _closed_status(item, self.output, finish_reason)
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=self._index(item), arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=self._index(item), item=item))
        done = finished(self.response, self.output, finish_reason, usage_)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=done)]

    def failed(self, code: str, message: str) -> list[dict]:
        return [self._event("response.failed", response={**self.response, "status": "failed",
                                                         "error": {"code": code, "message": message}})]

    def _added(self, item: dict) -> list[dict]:
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _index(self, item: dict) -> int:
        return next(i for i, out in enumerate(self.output) if out["id"] == item["id"])


def conversation(messages: list[dict], output: list[dict]) -> list[dict]:
    """The chat messages a follow-up continues: a response's own (instructions left out) and its output items
    as messages (its reasoning left out, as chat templates drop earlier turns' thinking)."""
    answer = [item for item in output if item["type"] in ("message", "function_call")]
    return messages + (chat_messages(answer, None) if answer else [])


class ResponseStore:
    """Stored responses by id, each with its conversation (conversation()): the newest `capacity`, the oldest
    going first, in this process's memory."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, messages: list[dict]) -> None:
        self._entries[response["id"]] = (response, messages)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
