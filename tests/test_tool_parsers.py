"""Tool-call parsers on the formats the model families write, and the stream that holds back only what may
open a call."""

from __future__ import annotations

import json

from capstan.runtime.server.tool_calls import ToolCallOutput
from capstan.runtime.server.tool_parsers import HermesParser, Llama3JSONParser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'


def test_hermes_blocks_after_text():
    text = f'Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{{"name": "now"}}</tool_call>'
    content, calls = HermesParser().parse(text)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "c"} and json.loads(calls[1].arguments) == {}


def test_hermes_malformed_or_absent_calls_stay_content():
    for text in ("Just text.", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert HermesParser().parse(text) == (text, [])


def test_llama3_json_with_python_tag_and_several_calls():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    content, calls = Llama3JSONParser().parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert Llama3JSONParser().parse("Hello {there}") == ("Hello {there}", [])
    assert Llama3JSONParser().parse('{"name": "a", "parameters": {"x": 1}} trailing') == (
        '{"name": "a", "parameters": {"x": 1}} trailing',
        [],
    )


def stream(output: ToolCallOutput, pieces: list[str]):
    s = output.stream()
    deltas = [d for p in pieces for d in s.feed(p)]
    more, reason = s.finish("stop")
    return deltas + more, reason


def test_auto_stream_sends_text_at_once_and_holds_a_call_until_it_closes():
    pieces = ["Sure", ", checking. <to", "ol_call>", WEATHER[:20], WEATHER[20:], "</tool_call>"]
    deltas, reason = stream(ToolCallOutput("auto", HermesParser()), pieces)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert content == "Sure, checking." and reason == "tool_calls"
    assert deltas[0].content == "Sure"  # not held: it cannot open a call
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    plain, reason = stream(ToolCallOutput("auto", HermesParser()), ["a <b> c", " <tool", "s>"])
    assert "".join(d.content for d in plain) == "a <b> c <tools>" and reason == "stop"


def test_named_stream_sends_arguments_as_they_come():
    deltas, reason = stream(ToolCallOutput("named", None, "get_weather"), ['{"city"', ': "Oslo"}'])
    first = deltas[0].tool_calls[0]
    assert first.id and first.function.name == "get_weather" and first.function.arguments == ""
    assert "".join(d.tool_calls[0].function.arguments for d in deltas[1:]) == '{"city": "Oslo"}'
    assert reason == "tool_calls"
