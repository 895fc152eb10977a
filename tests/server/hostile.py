"""Hostile request bodies for the fuzz tests: hypothesis strategies over OpenAI's request fields, and the
checks every answer must pass (no 5xx, OpenAI's error shape, a bounded time)."""

from __future__ import annotations

import json

import httpx
from hypothesis import strategies as st

# Numbers at and beyond every boundary a field could have: dtype limits, 0, -1, NaN, infinities.
EXTREME_INTS = [
    0,
    1,
    -1,
    2,
    20,
    21,
    255,
    256,
    2**15,
    2**31 - 1,
    2**31,
    -(2**31),
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    2**64,
    2**64 - 1,
    10**30,
    -(10**30),
]
ODD_TEXT = [
    "",
    "\x00",
    "a\x00b",
    "\ud800",
    "x\udfffy",
    "\ud83d\ude00",
    "é" * 3,
    "\u202e\u200b\ufeff",
    "𝕏" * 50,
    "日本語のテキスト",
    " " * 2000,
    "\n\t\r" * 100,
    "<|im_end|>",
    "<|endoftext|>",
    "\\u0000",
    "%s%n{0}",
]

ints = st.one_of(st.sampled_from(EXTREME_INTS), st.integers(min_value=-(2**70), max_value=2**70))
floats = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 1e308, -1e308, 5e-324]),
    st.floats(allow_nan=True, allow_infinity=True),
)
odd_text = st.one_of(st.sampled_from(ODD_TEXT), st.text(st.characters(codec=None), max_size=64))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, odd_text)


def deep(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


hostile_values = st.one_of(
    scalars,
    st.lists(scalars, max_size=8),
    st.lists(ints, min_size=0, max_size=3).map(lambda xs: xs * 2000),  # long lists of odd ids
    st.dictionaries(odd_text, scalars, max_size=6),
    st.sampled_from([deep(40), deep(900), {"a": deep(100)}, [[]] * 5000, [""] * 300, ["x"] * 17]),
)

SAMPLING_FIELDS = [
    "model",
    "n",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "stream",
    "stream_options",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "max_tokens",
]
COMPLETION_FIELDS = SAMPLING_FIELDS + ["prompt", "logprobs", "echo", "suffix", "best_of"]
CHAT_FIELDS = SAMPLING_FIELDS + [
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "response_format",
    "add_generation_prompt",
    "chat_template_kwargs",
]

message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
        "content": st.one_of(odd_text, hostile_values),
    }
)


def bodies(base: dict, fields: list[str]):
    """A valid body with one to four fields replaced by hostile values (so the hostility reaches deep code)."""
    overrides = st.dictionaries(
        st.sampled_from(fields + ["nonsense", "\ud800"]), hostile_values, min_size=1, max_size=4
    )
    return overrides.map(lambda o: {**base, **o})


completion_bodies = bodies({"prompt": "Hello", "max_tokens": 4}, COMPLETION_FIELDS)
chat_bodies = st.one_of(
    bodies({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}, CHAT_FIELDS),
    st.lists(message, max_size=3).map(lambda ms: {"messages": ms, "max_tokens": 4}),
)

# Bodies that are not JSON objects at all, with the content types clients get wrong.
RAW_BODIES = [
    (b"", "application/json"),
    (b"\xff\xfe\x00", "application/json"),
    (b'{"prompt": "\xc3\x28"}', "application/json"),
    (b'{"prompt": "a\x00b", "max_tokens": 2}', "application/json"),
    (b"[" * 100_000, "application/json"),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "application/json"),
    (b'{"prompt": "x", "n": 1' + b"0" * 5000 + b"}", "application/json"),
    (b"null", "application/json"),
    (b"[]", "application/json"),
    (b'"prompt"', "application/json"),
    (b"prompt=hi", "application/x-www-form-urlencoded"),
    (b'{"prompt": "hi"}', "text/plain"),
    (b'{"prompt": "hi", "max_tokens": 2}', "application/json; charset=latin-1"),
    (b"\x00" * 1000, ""),
    (b'{"prompt": NaN, "temperature": Infinity}', "application/json"),
]


def encode(body) -> bytes:
    """JSON as a hostile client may send it: lone surrogates as \\u escapes, NaN and Infinity literals."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def check_answer(response: httpx.Response) -> None:
    """No 5xx; every 4xx is OpenAI's error body; a 200 stream ends with [DONE], or a Responses API stream with
    its response.completed or response.incomplete event, and carries no error."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    elif content_type(response).startswith("text/event-stream"):
        text = response.text.rstrip()
        ended = not getattr(response, "stream_cut_short", False)  # schemathesis stops reading after 20 events
        if text.startswith("event: response.created"):  # the Responses API's typed events: its envelope has "error"
            last = text.rsplit("\n\n", 1)[-1]
            ends = ("event: response.completed", "event: response.incomplete")
            assert last.startswith(ends) or not ended, text[-300:]
            assert "event: error" not in text and "event: response.failed" not in text, text[-500:]
        else:
            assert text.endswith("data: [DONE]") or not ended, text[-300:]
            assert '"error"' not in text, text[-500:]


def content_type(response) -> str:
    value = response.headers.get("content-type", "")
    return value[0] if isinstance(value, list) else value  # schemathesis' responses list each header's values
