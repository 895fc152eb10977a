"""A real `capstan serve` under hostile requests: schemathesis from the server's own /openapi.json, hypothesis
bodies of extreme numbers, odd text, huge lists and deep nesting, raw bytes that are not JSON. Every answer is
under 500 and in OpenAI's error shape, none takes over 30 s, and afterwards the server is alive and ready, every
KV page is free and its memory is below a stated ceiling."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from hostile import RAW_BODIES, chat_bodies, check_answer, completion_bodies, encode
from hypothesis import HealthCheck, given, seed, settings
from servers import ServeProcess
from test_disconnect import gauges, wait_pool_free

pytestmark = pytest.mark.slow
REQUEST_TIMEOUT = 30.0  # seconds: no request may take longer, whatever it asks
RSS_CEILING_BYTES = 2 << 30  # the process after the whole fuzz run (docs/server.md works out the bound)
FUZZ = settings(
    max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
# A short context keeps every valid generation short, so the budget goes to hostile input, not decoding.
SERVER_FLAGS = (
    "--max-model-len=96",
    "--max-num-seqs=8",
    "--max-num-batched-tokens=64",
    "--decode-steps=4",
    "--max-waiting=64",
)


@pytest.fixture(scope="module")
def fuzz_server():
    with ServeProcess(*SERVER_FLAGS) as s:
        yield s
        # Whatever ran against it: it is alive, ready, holds no pages and no requests, and its memory is bounded.
        assert s.process.poll() is None, "the server died"
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{s.url}/ready", timeout=10).status_code == 200
        g = wait_pool_free(s.url)
        assert g["capstan_requests_waiting"] == 0
        rss = rss_bytes(s.process.pid)
        print(f"fuzz server RSS after the run: {rss / 2**20:.0f} MiB (ceiling {RSS_CEILING_BYTES / 2**20:.0f})")
        assert rss < RSS_CEILING_BYTES


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def send(url: str, path: str, content: bytes, content_type: str = "application/json") -> httpx.Response:
    started = time.monotonic()
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{url}{path}", content=content, headers=headers, timeout=REQUEST_TIMEOUT)
    assert time.monotonic() - started < REQUEST_TIMEOUT
    return response


# ---- the examples from the issue, and the limits they must name -----------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2147483648}, "n"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 9}, "n"),  # above --max-num-seqs
        ("/v1/completions", {"prompt": ["hi"] * 20, "max_tokens": 2, "n": 8}, "n"),  # 160 choices > --max-waiting
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 2147483648}, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1000000},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": "hi", "top_k": 9223372036854775808}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
        ("/v1/completions", {"prompt": "\ud800 hi"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]}, "messages[0].content"),
        ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": float("inf")}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**31}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 2**63}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": "x" * 1025}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * 33}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": float("nan")}}, "logit_bias"),
        ("/v1/completions", {"prompt": ["hi"] * 257}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "dry_multiplier": -1}, "dry_multiplier"),
        ("/v1/completions", {"prompt": "hi", "dry_base": float("nan")}, "dry_base"),
        ("/v1/completions", {"prompt": "hi", "dry_allowed_length": -3}, "dry_allowed_length"),
        ("/v1/completions", {"prompt": "hi", "dry_penalty_last_n": 2**31}, "dry_penalty_last_n"),
        ("/v1/completions", {"prompt": "hi", "dry_sequence_breakers": ["x"] * 10_000}, "dry_sequence_breakers"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "dry_sequence_breakers": ["x" * 2**20]},
            "dry_sequence_breakers",
        ),
        ("/v1/completions", {"prompt": [2**63]}, "prompt"),
        ("/v1/completions", {"prompt": "many words " * 300_000}, "prompt"),  # refused before it is tokenized
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "words " * 500_000}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 2049}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
            },
            "chat_template_kwargs",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "user": "u" * 257}, "user"),
        (  # an earlier call's arguments nested past what a JSON decoder or a template should recurse through
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[" * 60000}}],
                    }
                ]
            },
            "tool_calls[0].function.arguments",
        ),
        ("/v1/responses", {"input": "words " * 500_000}, "messages"),
        ("/v1/responses", {"input": [{"role": "user", "content": "hi"}] * 2049}, "input"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2**63}, "max_output_tokens"),
        ("/v1/responses", {"input": [{"role": "user", "content": "a\udfff"}]}, "input"),  # message: input[0].content
    ],
)
def test_out_of_bounds_is_400_naming_the_field_and_limit(fuzz_server, path, body, param):
    r = send(fuzz_server.url, path, encode(body))
    assert r.status_code == 400, r.text
    check_answer(r)
    error = r.json()["error"]
    assert error["param"].startswith(param), error  # e.g. messages[0].content or stop_token_ids[0]


@pytest.mark.parametrize("content, content_type", RAW_BODIES)
def test_bodies_that_are_not_json_objects_are_4xx(fuzz_server, content, content_type):
    r = send(fuzz_server.url, "/v1/completions", content, content_type)
    assert 400 <= r.status_code < 500 or r.status_code == 200, r.text
    check_answer(r)


def test_nul_bytes_and_odd_unicode_in_a_prompt_generate(fuzz_server):
    body = {"prompt": "a\x00b \u202e\u200b 日本 \ud83d\ude00 <|im_end|>", "max_tokens": 3}
    r = send(fuzz_server.url, "/v1/completions", encode(body))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# ---- generated: hypothesis bodies, then schemathesis from the server's own schema -----------------------------


@FUZZ
@seed(20261123)
@given(body=completion_bodies)
def test_hostile_completion_bodies(fuzz_server, body):
    check_answer(send(fuzz_server.url, "/v1/completions", encode(body)))


@FUZZ
@seed(20261124)
@given(body=chat_bodies)
def test_hostile_chat_bodies(fuzz_server, body):
    check_answer(send(fuzz_server.url, "/v1/chat/completions", encode(body)))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_openapi_schema_fuzz(fuzz_server, path, mode):
    """Bodies generated from the server's own /openapi.json: valid ones (within every bound it publishes) and
    invalid ones (each bound broken)."""
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operation = schema.find_operation_by_path("POST", path)

    @settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode))
    def fuzz(case):
        started = time.monotonic()
        response = case.call(base_url=fuzz_server.url, timeout=REQUEST_TIMEOUT)
        assert time.monotonic() - started < REQUEST_TIMEOUT
        check_answer(response)

    fuzz()


def test_metrics_after_the_fuzz_show_no_request_left(fuzz_server):
    g = wait_pool_free(fuzz_server.url)
    assert g["capstan_requests_running"] == 0 and g["capstan_requests_waiting"] == 0
    assert gauges(fuzz_server.url)["capstan_kv_pages_free"] == g["capstan_kv_pages_total"]
