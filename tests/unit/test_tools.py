"""Tool calls planned as structured output (frontend/tools.py): the schemas, the refusals, and the calls read
back from the text, whole and streamed."""
from __future__ import annotations

import json

import jsonschema
import pytest

from frontend.tools import ToolCallStream, ToolError, plan_tool_calls
from pagedserve.chat import template_messages
from tests.support.http_app import http_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_no_tools_or_none_decode_text():
    assert plan_tool_calls(None, None) is None
    assert plan_tool_calls([WEATHER], "none") is None


def test_a_named_function_is_decoded_under_its_parameters():
    plan = plan_tool_calls([WEATHER, TIME], NAMED)
    assert json.loads(plan.schema) == WEATHER["function"]["parameters"] and plan.function == "get_weather"
    message, finish = plan.message('{"city": "Paris"}', "stop")
    [call] = message["tool_calls"]
    assert message["content"] is None and finish == "stop"
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_required_is_a_list_of_calls_over_the_tools():
    schema = json.loads(plan_tool_calls([WEATHER, TIME], "required").schema)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {"tz": 1}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(plan_tool_calls([WEATHER, TIME], "required", parallel_tool_calls=False).schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)

    plan = plan_tool_calls([WEATHER, TIME], "required")
    message, finish = plan.message(json.dumps(good), "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"tz": 1})]
    # Cut short, the list does not parse: it comes back as text, finish as it was.
    assert plan.message('[{"name": "get_wea', "length") == ({"role": "assistant", "content": '[{"name": "get_wea'},
                                                            "length")


@pytest.mark.parametrize(("tools", "tool_choice", "field"), [
    ([WEATHER], "auto", "tool_choice"),
    ([WEATHER], None, "tool_choice"),  # OpenAI's default with tools is auto
    (None, "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {}}], "required", "tools"),
    ([{"type": "retrieval"}], "required", "tools"),
    ([WEATHER, WEATHER], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "required", "tools"),
])
def test_what_cannot_apply_is_refused_naming_the_field(tools, tool_choice, field):
    with pytest.raises(ToolError) as info:
        plan_tool_calls(tools, tool_choice)
    assert info.value.field == field


def test_streamed_calls_add_up_to_the_whole_ones():
    named = ToolCallStream(plan_tool_calls([WEATHER], NAMED))
    first, _ = named.delta(0, '{"city"', True, None)
    later, finish = named.delta(0, ': "Rome"}', False, "stop")
    assert first["role"] == "assistant" and first["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                                   "arguments": '{"city"'}
    assert later == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Rome"}'}}]} and finish == "stop"

    required = ToolCallStream(plan_tool_calls([WEATHER, TIME], "required"))
    text = '[{"name": "get_time", "parameters": {}}]'
    assert required.delta(1, text[:10], True, None) == ({"role": "assistant"}, None)  # held until whole
    last, finish = required.delta(1, text[10:], False, "stop")
    assert finish == "tool_calls" and [c["function"]["name"] for c in last["tool_calls"]] == ["get_time"]
    assert last["tool_calls"][0]["index"] == 0 and last["tool_calls"][0]["function"]["arguments"] == "{}"


def test_earlier_calls_reach_the_template_with_their_arguments_as_objects():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    odd = {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call, odd]},
                {"role": "tool", "content": "12 C", "tool_call_id": "c1"}]
    rendered = template_messages(messages)
    assert rendered[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert rendered[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert rendered[1] == messages[1] and call["function"]["arguments"] == '{"city": "Oslo"}'  # not changed


HERMES_OUTPUT = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_auto_needs_the_servers_parser_and_then_reads_hermes_calls():
    plan = plan_tool_calls([WEATHER, TIME], "auto", auto_parser="hermes")
    assert plan.schema is None and plan_tool_calls([WEATHER], None, auto_parser="hermes") is not None
    message, finish = plan.message(HERMES_OUTPUT, "stop")
    assert message["content"] == "Let me look." and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert plan.message("Sunny, I think.", "stop") == ({"role": "assistant", "content": "Sunny, I think."}, "stop")
    broken = 'Well <tool_call>{"name": get_weather}</tool_call>'  # not JSON: the text, whole
    assert plan.message(broken, "stop") == ({"role": "assistant", "content": broken}, "stop")
    # A call cut short by max_tokens whose JSON still closed is a call; finish stays length.
    assert plan.message('<tool_call>{"name": "get_time", "arguments": {}}', "length")[1] == "length"


# Each parser's syntax for the two calls of HERMES_OUTPUT: get_weather(city="Oslo"), get_time().
CALLS = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
OUTPUTS = {
    "mistral": ['Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]',
                'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
                    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}};'
                    '{"name": "get_time", "parameters": {}}'],
    "granite": ['Let me look.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]'],
    "pythonic": ['[get_weather(city="Oslo"), get_time()]', " [get_weather(city='Oslo'), get_time()]"],
}


def read_calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_each_parser_reads_its_models_calls_and_leaves_anything_else_as_text(parser):
    plan = plan_tool_calls([WEATHER, TIME], "auto", auto_parser=parser)
    for text in OUTPUTS[parser]:
        message, finish = plan.message(text, "stop")
        assert read_calls(message) == CALLS and finish == "tool_calls", text
        assert message["content"] == ("Let me look." if text.startswith("Let") else None)
    not_calls = ["Sunny, I think.", "[1] is the source.", '{"answer": 4}', "It is {warm}.", "[TOOL_CALLS]oops",
                 '<|tool_call|>[{"name": ""}]', "[get_weather(**kwargs)]", "[get_weather('Oslo')]",
                 "[get_weather(city=input())]", "[x[0](a=1)]", '[TOOL_CALLS]get_time[ARGS]{bad']
    for text in not_calls:
        assert plan.message(text, "length") == ({"role": "assistant", "content": text}, "length"), text


def test_calls_open_a_llama3_or_pythonic_output_only_at_its_start():
    for parser, text in (("llama3_json", 'Use {"name": "get_time", "parameters": {}}'),
                         ("pythonic", "Try [get_time()]")):
        plan = plan_tool_calls([WEATHER, TIME], "auto", auto_parser=parser)
        assert plan.message(text, "stop") == ({"role": "assistant", "content": text}, "stop")
        stream = plan.stream()
        first, _ = stream.delta(0, text[:5], True, None)
        assert first["content"] == text[:5]  # streamed at once: no call can open after text
        rest, _ = stream.delta(0, text[5:], False, "stop")
        assert first["content"] + rest["content"] == text


STREAMED = [("hermes", HERMES_OUTPUT), ("hermes", "Just text, with a < and a <tool"),
            ("hermes", 'A <tool_call>{"name": 1}')] + [(parser, text) for parser, texts in OUTPUTS.items()
                                                       for text in texts] + [
    ("mistral", "A [TOOL plan"), ("llama3_json", " {not json"), ("pythonic", "[not, calls]"), ("granite", "<|tool")]


@pytest.mark.parametrize("parser,text", STREAMED)
def test_auto_streamed_adds_up_to_the_whole_answer_wherever_the_text_splits(parser, text):
    plan = plan_tool_calls([WEATHER, TIME], "auto", auto_parser=parser)
    whole, whole_finish = plan.message(text, "stop")
    for cut in range(1, len(text)):
        for pieces in ([text[:cut], text[cut:]], [text[:cut], text[cut:-1], text[-1]]):
            stream = plan.stream()
            deltas = [stream.delta(0, piece, i == 0, "stop" if i == len(pieces) - 1 else None)
                      for i, piece in enumerate(pieces)]
            content = "".join(d.get("content", "") for d, _ in deltas)
            calls = [c for d, _ in deltas for c in d.get("tool_calls", [])]
            assert deltas[-1][1] == whole_finish
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls") or []]
            if whole.get("tool_calls"):
                assert content.strip() == (whole["content"] or "")
            else:
                assert content == text


def test_a_server_without_a_parser_refuses_auto_over_http_saying_what_to_send():
    for choice in ({}, {"tool_choice": "auto"}):  # with tools, OpenAI's default is auto
        response = http_app().post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **choice})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
        assert '"required"' in response.json()["error"]["message"]
