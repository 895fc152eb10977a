"""Bad input and missing keys over raw HTTP: OpenAI's error body and status code, never a 500 or a trace."""

from __future__ import annotations

import httpx
import openai
import pytest
from servers import API_KEYS, MODEL

pytestmark = pytest.mark.slow


def post(url: str, path: str, body=None, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "temperature": 5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ],
)
def test_completion_bad_values_are_400_naming_the_field(server, body, param):
    assert error_of(post(server, "/v1/completions", body), 400)["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ],
)
def test_chat_bad_values_are_400_naming_the_field(server, body, param):
    assert error_of(post(server, "/v1/chat/completions", body), 400)["param"] == param


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        (
            "/v1/completions",
            {"prompt": [2**63]},
            "prompt",
            "prompt[0]: Input should be less than or equal to 2147483647",
        ),
        (
            "/v1/completions",
            {"prompt": [[1], [-1]]},
            "prompt",
            "prompt[1][0]: Input should be greater than or equal to 0",
        ),
        ("/v1/completions", {"prompt": ["a", 3]}, "prompt", "prompt[1]: Input should be a valid string"),
        ("/v1/chat/completions", {"messages": HI, "stop": ["x"] * 10000}, "stop", "stop: List should have at most 16"),
        (
            "/v1/chat/completions",
            {"messages": HI, "stop": "x" * 2000},
            "stop",
            "stop: should have at most 1024 characters",
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "stop": ["x", ""]},
            "stop",
            "stop[1]: should have at least 1 character,",
        ),
    ],
)
def test_a_field_of_several_kinds_says_what_is_wrong_with_the_kind_sent(server, path, body, param, message):
    """A union's error comes from the member the input's kind matched (a token list's bound, not 'should be a
    valid string'), naming the item; a string's length bound is said in characters."""
    error = error_of(post(server, path, body), 400)
    assert error["param"] == param and error["message"].startswith(message), error


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert "malformed JSON" in error_of(r, 400)["message"]


def test_prompt_longer_than_the_context_names_the_limit(server):
    error = error_of(post(server, "/v1/completions", {"prompt": "hello " * 600}), 400)
    assert error["param"] == "prompt" and "512" in error["message"]


def test_unknown_model_is_404(server):
    error = error_of(
        post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404
    )
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_body_over_the_limit_is_413(server):
    assert error_of(post(server, "/v1/completions", {"prompt": "x" * 100_000}), 413)["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        for _ in range(100):
            yield b"x" * 1024

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    error_of(r, 413)


def test_unknown_route_and_method(server):
    error_of(httpx.get(f"{server}/v1/nothing"), 404)
    error_of(httpx.get(f"{server}/v1/completions"), 405)


def test_api_keys_guard_v1_but_not_probes(keyed_server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert error_of(post(keyed_server, "/v1/completions", body), 401)["code"] == "invalid_api_key"
    error_of(post(keyed_server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    error_of(httpx.get(f"{keyed_server}/v1/models", headers={"Authorization": "Basic key-one"}), 401)
    for key in API_KEYS:
        assert (
            post(keyed_server, "/v1/completions", body, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        )
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{keyed_server}{probe}").status_code == 200


def test_the_key_is_checked_before_the_body_is_read(keyed_server):
    r = httpx.post(
        f"{keyed_server}/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert error_of(r, 401)["code"] == "invalid_api_key"


def test_openai_client_raises_its_typed_errors(keyed_server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key=API_KEYS[1], max_retries=0)
    assert [m.id for m in client.models.list().data] == ["served-name", MODEL]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="served-name", prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
