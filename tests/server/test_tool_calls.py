"""Tool calling through the openai SDK's own helpers: `required` and a named function are structured outputs
over the tools' schemas, so even a random-weight model calls them with arguments that parse; streams carry
the calls as OpenAI streams them; tool results render back through the chat template."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from servers import MODEL

pytestmark = pytest.mark.slow


class GetWeather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = pydantic.Field(ge=1, le=7)


class GetTime(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    zone: Literal["UTC", "CET"]


TOOLS = [
    openai.pydantic_function_tool(GetWeather, name="get_weather"),
    openai.pydantic_function_tool(GetTime, name="get_time"),
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_required_calls_parse_with_the_sdk_helper(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=450, temperature=0.9, seed=2
    )  # up to 8 parallel calls
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert isinstance(
            call.function.parsed_arguments, {"get_weather": GetWeather, "get_time": GetTime}[call.function.name]
        )


def test_named_function_and_one_call_without_parallel_calls(client):
    r = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and isinstance(call.function.parsed_arguments, GetTime)
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        n=3,
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        seed=4,
    )
    assert all(len(c.message.tool_calls) == 1 for c in r.choices)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_accumulate_in_the_sdk_stream_helper(client, tool_choice):
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0.5,
        seed=7,
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert all(call.function.parsed_arguments is not None for call in choice.message.tool_calls)


def test_a_tool_result_goes_back_through_the_template(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})},
    }
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 20


def test_auto_answers_with_content_or_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16, temperature=0)
    message = r.choices[0].message
    assert message.content is not None or message.tool_calls


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}
                        ],
                    }
                ]
            },
            "tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
