"""POST /v1/responses through the openai SDK's `client.responses`, checked against the SDK's own types (validated
strictly: every field the SDK requires, of its type) and against /v1/chat/completions on the same conversation:
greedy answers are the same tokens, whole or streamed."""

from __future__ import annotations

import json
from typing import Any, cast

import httpx
import openai
import pytest
from hostile import check_answer
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from servers import MODEL
from test_errors import error_of, post
from test_tool_calls import TOOLS, GetTime, GetWeather

pytestmark = pytest.mark.slow
EVENTS: TypeAdapter = TypeAdapter(cast(Any, ResponseStreamEvent))  # the SDK's union of event types, by `type`


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def raw_response(server, body) -> Response:
    r = httpx.post(f"{server}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return Response.model_validate(r.json())  # strict: raises on a missing or mistyped field


def raw_events(server, body) -> list:
    events = []
    with httpx.stream("POST", f"{server}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        named = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                named = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append(EVENTS.validate_python(json.loads(line[len("data: ") :])))
                assert events[-1].type == named  # each event named on its `event:` line, as OpenAI sends them
    return events


def test_a_response_is_the_chat_answer_to_the_same_conversation(server, client):
    body = {"model": MODEL, "instructions": "You are terse.", "input": "Say hello.", "max_output_tokens": 12}
    r = raw_response(server, {**body, "temperature": 0})
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text == chat.choices[0].message.content
    finished_by_length = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if finished_by_length else "completed")
    assert (
        r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    ) == finished_by_length
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "You are terse." and r.max_output_tokens == 12 and r.temperature == 0


def test_the_sdk_reads_a_response_and_a_message_list(client):
    r = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Hi."},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Count to three."}]},
        ],
        max_output_tokens=6,
        metadata={"team": "search"},
    )
    assert r.status in ("completed", "incomplete") and r.metadata == {"team": "search"}
    assert 0 < r.usage.output_tokens <= 6 and isinstance(r.output_text, str)


def test_a_stream_is_the_apis_events_and_adds_up_to_the_whole_response(server):
    body = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 10, "temperature": 0}
    whole = raw_response(server, body)
    events = raw_events(server, body)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    check_answer(httpx.post(f"{server}/v1/responses", json={**body, "stream": True}, timeout=120))  # the fuzz's check


def test_function_calls_are_output_items_and_go_back_in_as_input(client):
    tools = [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS
    ]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.responses.create(
        model=MODEL,
        input=ask,
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    GetWeather.model_validate_json(calls[0].arguments)  # constrained to the tool's schema
    follow_up = [*ask, *r.output, {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny."}]
    again = client.responses.create(model=MODEL, input=follow_up, tools=tools, max_output_tokens=5)
    assert again.status in ("completed", "incomplete")


def test_a_streamed_function_call(server):
    tools = [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS
    ]
    choice = {"type": "function", "name": "get_time"}
    body = {"model": MODEL, "input": "Time?", "tools": tools, "tool_choice": choice, "max_output_tokens": 100}
    events = raw_events(server, {**body, "temperature": 0.9, "seed": 3})
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.name for e in done] == ["get_time"]
    GetTime.model_validate_json(done[0].arguments)
    final = events[-1].response
    assert [item.arguments for item in final.output if item.type == "function_call"] == [e.arguments for e in done]


def test_text_format_json_schema_constrains_the_output(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL,
        input="Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        max_output_tokens=40,
    )
    assert isinstance(json.loads(r.output_text)["ok"], bool)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        (
            {
                "input": "hi",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice.name",
        ),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 60000}]},
            "input[0].arguments",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 200 + "]" * 200}]},
            "input[0].arguments",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        ({"input": []}, "input"),
        ({"input": "hi", "max_output_tokens": 2**63}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_bad_requests_are_400_naming_the_field(server, body, param):
    assert error_of(post(server, "/v1/responses", {"model": MODEL, **body}), 400)["param"] == param


def test_nan_temperature_is_400_naming_it(server):
    body = f'{{"model": "{MODEL}", "input": "hi", "temperature": NaN}}'
    r = httpx.post(f"{server}/v1/responses", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert error_of(r, 400)["param"] == "temperature"
