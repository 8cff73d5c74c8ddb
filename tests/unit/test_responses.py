"""The Responses API's input items as chat messages, and its output items and events (frontend/responses.py)."""
from __future__ import annotations

import json

import pytest

from frontend.responses import (ResponseEvents, ResponsesError, ResponseStore, chat_messages, chat_tool_choice,
                                chat_tools, conversation, output_items, text_format, usage)


def test_input_items_become_the_chat_conversation():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                     "text": "Oslo and Rome?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "12 C"},
        {"type": "function_call_output", "call_id": "c2", "output": "20 C"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Oslo 12, Rome 20."}]},
    ]
    messages = chat_messages(items, "Be brief.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert messages[0]["content"] == "Be brief." and messages[1]["content"] == "Weather in Oslo and Rome?"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one turn
    assert messages[3] == {"role": "tool", "content": "12 C", "tool_call_id": "c1"}
    assert chat_messages("Hi", None) == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("items", [[], [{"type": "image"}], [{"role": "user", "content": [{"type": "input_image"}]}],
                                   [{"type": "function_call", "name": "f"}], ["hi"]])
def test_what_the_chat_path_cannot_carry_is_refused_naming_input(items):
    with pytest.raises(ResponsesError) as info:
        chat_messages(items, None)
    assert info.value.field == "input"


def test_function_tools_tool_choice_and_text_format_map_to_the_chat_apis():
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    assert chat_tools([tool]) == [{"type": "function", "function": {"name": "f", "description": "d",
                                                                    "parameters": {"type": "object"}}}]
    with pytest.raises(ResponsesError, match="web_search"):
        chat_tools([{"type": "web_search"}])
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    assert text_format(None) == (None, False) and text_format({"format": {"type": "json_object"}}) == (None, True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(text_format({"format": {"type": "json_schema", "name": "x", "schema": schema}})[0]) == schema
    with pytest.raises(ResponsesError):
        text_format({"format": {"type": "json_schema"}})


def test_output_items_hold_the_text_then_the_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    items = output_items({"role": "assistant", "content": "Let me look.", "tool_calls": [call]}, "tool_calls")
    assert [i["type"] for i in items] == ["message", "function_call"]
    assert items[0]["content"][0]["text"] == "Let me look." and items[1]["call_id"] == "call_1"
    assert [i["status"] for i in items] == ["completed", "completed"]
    assert output_items({"role": "assistant", "content": None, "tool_calls": [call]},
                        "tool_calls")[0]["type"] == "function_call"


def test_the_item_the_length_cut_short_is_incomplete_and_keeps_its_text():
    cut = output_items({"role": "assistant", "reasoning": "Think.", "content": "Paris is"}, "length")
    assert [(i["type"], i["status"]) for i in cut] == [("reasoning", "completed"), ("message", "incomplete")]
    assert cut[1]["content"][0]["text"] == "Paris is"
    thinking = output_items({"role": "assistant", "reasoning": "Think", "content": None}, "length")
    assert [(i["type"], i["status"]) for i in thinking] == [("reasoning", "incomplete")]
    assert thinking[0]["content"][0]["text"] == "Think"


def test_events_open_each_item_as_it_begins_and_close_them_in_order():
    events = ResponseEvents({"id": "resp_1", "status": "in_progress", "output": []})
    seen = events.start()
    seen += events.delta({"role": "assistant", "content": "Checking"})
    seen += events.delta({"content": "."})
    seen += events.delta({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a"'}}]})
    seen += events.delta({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
    seen += events.finish("length", usage(5, 7))
    assert [e["type"] for e in seen] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    final = seen[-1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["total_tokens"] == 12
    assert final["output"][0]["content"][0]["text"] == "Checking."
    # The length cut the call short, not the text before it.
    assert final["output"][0]["status"] == "completed"
    assert final["output"][1]["arguments"] == '{"a": 1}' and final["output"][1]["status"] == "incomplete"
    done_items = [e["item"] for e in seen if e["type"] == "response.output_item.done"]
    assert [i["status"] for i in done_items] == ["completed", "incomplete"]
    assert [e["output_index"] for e in seen if e["type"] == "response.output_item.done"] == [0, 1]


def test_the_store_keeps_the_newest_responses_with_the_conversation_a_follow_up_continues():
    store = ResponseStore(2)
    asked = chat_messages([{"role": "user", "content": "Weather in Oslo?"}], None)
    output = output_items({"reasoning": "Look it up.", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        "tool_calls")
    for n in range(3):
        store.put({"id": f"resp_{n}", "output": output}, conversation(asked, output))
    assert store.get("resp_0") is None  # gone to make room
    response, messages = store.get("resp_2")
    assert response["id"] == "resp_2"
    # The thinking is left out; the text and the call become the assistant's turn.
    assert messages == asked + [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    assert store.delete("resp_1") and not store.delete("resp_1") and store.get("resp_1") is None
