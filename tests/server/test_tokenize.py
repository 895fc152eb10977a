"""/tokenize, /detokenize, /tokenizer_info and /version in vLLM's shapes, through httpx against the real server."""

from __future__ import annotations

import json

import httpx
import pytest
from servers import MODEL

import capstan

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Say hello."}]


def test_tokenize_prompt_round_trips(server, engine):
    r = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": "Hello there", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == engine.tokenizer.encode("Hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and len(body["token_strs"]) == body["count"]
    back = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello there"}
    assert "token_strs" not in httpx.post(f"{server}/tokenize", json={"prompt": "Hello"}).json()


def test_tokenize_messages_counts_what_chat_runs(server):
    tokens = httpx.post(f"{server}/tokenize", json={"messages": CHAT}).json()
    chat = httpx.post(f"{server}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}, timeout=60).json()
    assert tokens["count"] == chat["usage"]["prompt_tokens"] == len(tokens["tokens"])
    without = httpx.post(f"{server}/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert without["count"] < tokens["count"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ],
)
def test_bad_requests_name_the_field(server, path, body, param):
    content = json.dumps(body).encode()  # ASCII escapes, so "\ud800" reaches the server as a lone surrogate
    r = httpx.post(f"{server}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_detokenize_bounds_its_tokens(keyed_server):
    # the open test server caps bodies at 64 KiB; the keyed one has the default 4 MiB
    r = httpx.post(
        f"{keyed_server}/detokenize",
        json={"tokens": [1] * 131073},
        timeout=30,
        headers={"Authorization": "Bearer key-one"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_tokenize_needs_the_key_when_keys_are_set(keyed_server):
    assert httpx.post(f"{keyed_server}/tokenize", json={"prompt": "x"}).status_code == 401
    ok = httpx.post(f"{keyed_server}/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer key-one"})
    assert ok.status_code == 200


def test_tokenizer_info_names_the_special_tokens_and_template(server, engine, keyed_server):
    info = httpx.get(f"{server}/tokenizer_info").json()
    tokenizer = engine.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 512
    assert httpx.get(f"{keyed_server}/tokenizer_info").status_code == 401


def test_version(server):
    assert httpx.get(f"{server}/version").json() == {"version": capstan.__version__}
