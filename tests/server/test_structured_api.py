"""Structured outputs over the API, as applications ask for them: the openai SDK's `parse` helper with a
pydantic model (response_format json_schema, strict), JSON mode, and vLLM's structured_outputs / guided_*
extras; invalid grammars are 400s naming the field."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from servers import MODEL

pytestmark = pytest.mark.slow


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    kind: Literal["cat", "dog"]
    name: str = pydantic.Field(max_length=10)
    legs: int = pydantic.Field(ge=0, le=8)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_sdk_parse_helper_gets_its_model_back(client):
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "A pet, please"}],
        response_format=Pet,
        max_tokens=200,
        temperature=0.7,
        seed=1,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)


def test_json_mode_and_streaming_json_schema(client):
    schema = Pet.model_json_schema()
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A pet"}],
        stream=True,
        max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Pet.model_validate_json(text)
    r = client.completions.create(
        model=MODEL,
        prompt="JSON:",
        max_tokens=300,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{3}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{3}", t)),
        ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        (
            {
                "guided_json": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                    "additionalProperties": False,
                }
            },
            lambda t: isinstance(json.loads(t)["ok"], bool),
        ),
        (
            {"structured_outputs": {"grammar": 'start: "a" ("b" | "c") ("b" | "c") "."'}},
            lambda t: re.fullmatch(r"a[bc][bc]\.", t),
        ),
    ],
)
def test_vllm_extras(client, extra, check):
    r = client.completions.create(
        model=MODEL, prompt="Say:", max_tokens=60, temperature=1.0, n=3, seed=5, extra_body=extra
    )
    for choice in r.choices:  # every grammar here is bounded: each output ends, and matches
        assert choice.finish_reason == "stop" and check(choice.text), choice


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_invalid_structured_outputs_are_400_naming_the_field(server, body, param):
    r = httpx.post(
        f"{server}/v1/chat/completions", timeout=60, json={"messages": [{"role": "user", "content": "hi"}], **body}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
