"""client_keys.py, budgets.py and usage_meter.py: key files (hashed, validated, reloaded), budget windows and shares,
and the usage read from responses as they pass."""

from __future__ import annotations

import hashlib
import json

import pytest

from capstan.runtime.gateway.budgets import Budgets, Refusal, Reservation
from capstan.runtime.gateway.client_keys import ClientKey, KeyRing, digest_of, parse_clients
from capstan.runtime.gateway.request_cost import generation_fields
from capstan.runtime.gateway.usage_meter import UsageMeter, ask_for_usage

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"


def write(path, text):
    path.write_text(text)
    return str(path)


def test_keys_are_kept_as_digests_and_authenticate_bearer_headers(tmp_path):
    ring = KeyRing([write(tmp_path / "a.yaml", f"clients: [{{name: a, key: {KEY_A}, models: [tiny]}}]\n")])
    (client,) = ring.clients
    assert client.digest == hashlib.sha256(KEY_A.encode()).digest() and KEY_A not in repr(client)
    assert ring.authenticate(f"Bearer {KEY_A}") is client
    for header in (None, "", KEY_A, f"Basic {KEY_A}", f"Bearer {KEY_B}", "Bearer "):
        assert ring.authenticate(header) is None, header


def test_a_folder_of_secret_files_and_sha256_keys(tmp_path):
    (tmp_path / "..data").mkdir()  # the kubelet's bookkeeping in a mounted Secret
    write(tmp_path / "a.yaml", f"clients: [{{name: a, key: {KEY_A}, models: ['*']}}]")
    write(
        tmp_path / "b.yaml",
        f"clients: [{{name: b, keySha256: {hashlib.sha256(KEY_B.encode()).hexdigest()}, "
        "models: ['qwen3', 'qwen3-lora-*']}]",
    )
    ring = KeyRing([str(tmp_path)])
    b = ring.authenticate(f"Bearer {KEY_B}")
    assert b.name == "b" and b.may_use("qwen3") and b.may_use("qwen3-lora-sql") and not b.may_use("llama")
    assert ring.authenticate(f"Bearer {KEY_A}").may_use("anything")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("clients: [{key: sk-0123456789abcdef, models: [m]}]", "clients[0].name"),
        ("clients: [{name: a, models: [m]}]", "exactly one of `key` or `keySha256`"),
        ("clients: [{name: a, key: short, models: [m]}]", "clients[0].key: a string of 16"),
        ("clients: [{name: a, keySha256: abc, models: [m]}]", "clients[0].keySha256: 64 hex digits"),
        ("clients: [{name: a, key: sk-0123456789abcdef, models: []}]", "clients[0].models"),
        ("clients: [{name: a, key: sk-0123456789abcdef, models: [m], requestsPerMinute: 0}]", "requestsPerMinute"),
        ("clients: [{name: a, key: sk-0123456789abcdef, models: [m], rpm: 5}]", "unknown field(s) rpm"),
        ("clients: {}", "a list `clients`"),
    ],
)
def test_bad_files_are_refused_naming_the_field(text, words):
    with pytest.raises(ValueError, match=None) as error:
        parse_clients(text, "keys.yaml")
    assert words in str(error.value) and str(error.value).startswith("keys.yaml"), error.value


def test_rotation_takes_effect_and_a_broken_file_keeps_the_keys_in_force(tmp_path):
    path = tmp_path / "keys.yaml"
    ring = KeyRing([write(path, f"clients: [{{name: a, key: {KEY_A}, models: [m]}}]")])
    assert not ring.reload()  # unchanged
    write(path, f"clients: [{{name: a, key: {KEY_B}, models: [m]}}]")
    assert ring.reload()
    assert ring.authenticate(f"Bearer {KEY_A}") is None and ring.authenticate(f"Bearer {KEY_B}").name == "a"
    write(path, "clients: [{name: a}]")
    assert not ring.reload() and ring.authenticate(f"Bearer {KEY_B}").name == "a"
    write(path, f"clients: [{{name: a, key: {KEY_A}, models: [m]}}, {{name: a, key: {KEY_B}, models: [m]}}]")
    assert not ring.reload()  # duplicate names: refused, old keys stay


class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def client(**limits) -> ClientKey:
    return ClientKey("a", digest_of(KEY_A), ("*",), **limits)


def test_requests_budget_refuses_then_recovers_in_the_next_window():
    clock = Clock(1200.0)
    budgets, c = Budgets(window_seconds=60, clock=clock), client(requests_per_minute=3)
    for _ in range(3):
        budgets.settle(budgets.admit(c), 10)
    refusal = budgets.admit(c)
    assert refusal.reason == "requests" and refusal.retry_after == 60
    assert budgets.headers(c) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "60.000s",
    }
    clock.now += 60
    assert isinstance(budgets.admit(c), Reservation)


def test_a_burst_reserves_each_worst_case_so_the_window_never_passes_its_budget():
    """The issue's burst: 8 requests at once, each of which may use 30 tokens, against 100 tokens a minute."""
    clock = Clock(0.0)
    budgets, c = Budgets(window_seconds=60, clock=clock), client(tokens_per_minute=100, max_concurrent=16)
    taken = [budgets.admit(c, 30) for _ in range(8)]
    admitted = [t for t in taken if isinstance(t, Reservation)]
    refused = [t for t in taken if isinstance(t, Refusal)]
    assert len(admitted) == 3 and {r.reason for r in refused} == {"tokens"} and refused[0].retry_after == 60
    assert budgets.headers(c)["x-ratelimit-remaining-tokens"] == "10"  # reserved counts as used until it ends
    budgets.settle(admitted[0], 2)  # it used less than its worst case: the rest is free again
    assert budgets.charged(c) == 2 and isinstance(budgets.admit(c, 30), Reservation)
    for r in admitted[1:]:
        budgets.settle(r, 30)
    assert budgets.charged(c) == 62 and budgets.refusal(c, 30).reason == "tokens"
    too_large = budgets.admit(c, 101)
    assert too_large.reason == "tokens" and "whole budget" in too_large.message


def test_a_request_is_charged_to_the_window_that_admitted_it():
    clock = Clock(50.0)
    budgets, c = Budgets(window_seconds=60, clock=clock), client(tokens_per_minute=100)
    late = budgets.admit(c, 90)
    assert budgets.refusal(c, 20).reason == "tokens"
    clock.now = 61.0  # a new window: the old one's reservation is not this one's
    assert budgets.refusal(c, 100) is None
    budgets.settle(late, 90)
    assert budgets.charged(c) == 0 and budgets.refusal(c, 100) is None


def test_concurrency_is_capped_and_a_slot_frees_when_a_request_ends():
    clock = Clock(0.0)
    budgets, c = Budgets(window_seconds=60, clock=clock), client(max_concurrent=2)
    first, second = budgets.admit(c), budgets.admit(c)
    refusal = budgets.admit(c)
    assert refusal.reason == "concurrency" and refusal.retry_after == 1.0
    budgets.settle(first, 0)
    assert isinstance(budgets.admit(c), Reservation)
    with pytest.raises(AssertionError):
        budgets.settle(first, 0)  # settled once only
    assert isinstance(second, Reservation)


def test_shares_split_every_budget_so_replicas_together_stay_within_it():
    c = client(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=4)
    assert Budgets(60, shares=1).limits(c) == (10, 1000, 4)
    assert Budgets(60, shares=2).limits(c) == (5, 500, 2)
    assert Budgets(6, shares=2).limits(c) == (1, 50, 2)  # a short window scales the per-minute budgets


def test_the_meter_reads_usage_and_drops_only_the_usage_chunk_it_asked_for():
    def ask(path: str, body: dict) -> tuple[dict, bool]:
        return ask_for_usage(body, generation_fields(path, body))

    body, wanted = ask("/v1/completions", {"model": "m", "stream": True})
    assert body["stream_options"] == {"include_usage": True} and not wanted
    assert ask("/v1/completions", {"model": "m", "stream": True, "stream_options": {"include_usage": True}})[1]
    # read as the server reads them: the string "false" is false, so the gateway asks for the usage itself
    body, wanted = ask(
        "/v1/chat/completions", {"model": "m", "stream": "true", "stream_options": {"include_usage": "false"}}
    )
    assert body["stream_options"] == {"include_usage": True} and not wanted
    assert ask("/v1/responses", {"model": "m", "stream": "false"}) == ({"model": "m", "stream": "false"}, True)
    assert ask("/v1/embeddings", {"model": "m", "stream": "garbage"})[1]  # a field embeddings do not read
    events = [
        {"choices": [{"text": "a"}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}},
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    for wants in (False, True):
        meter, out = UsageMeter(streaming=True, client_wants_usage=wants), b""
        for i in range(0, len(stream), 7):  # events split across reads
            out += meter.feed(stream[i : i + 7])
        out += meter.close()
        assert (meter.prompt_tokens, meter.completion_tokens, meter.delivered) == (7, 3, 1)
        assert meter.finished  # [DONE] went through: a client that hangs up now had the whole answer (proxy.py)
        assert (b'"prompt_tokens"' in out) == wants and out.endswith(b"data: [DONE]\n\n") and b'"text": "a"' in out
    meter = UsageMeter(streaming=False)
    whole = json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}).encode()
    assert meter.feed(whole[:10]) + meter.feed(whole[10:]) + meter.close() == whole and meter.tokens == 7


def test_the_meter_reads_the_responses_apis_usage_and_keeps_every_event():
    usage = {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}
    events = [
        {"type": "response.created", "sequence_number": 0, "response": {"status": "in_progress", "usage": None}},
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": "a"},
        {"type": "response.completed", "sequence_number": 2, "response": {"status": "completed", "usage": usage}},
    ]
    stream = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
    meter = UsageMeter(streaming=True, client_wants_usage=False)  # it asked for nothing: the events are all there is
    out = b"".join(meter.feed(stream[i : i + 11]) for i in range(0, len(stream), 11)) + meter.close()
    assert out == stream and (meter.prompt_tokens, meter.completion_tokens) == (9, 4) and meter.finished
    cut = UsageMeter(streaming=True)
    cut.feed(stream[: len(stream) // 2])
    assert not cut.finished
    meter = UsageMeter(streaming=False)
    whole = json.dumps({"object": "response", "usage": usage}).encode()
    assert meter.feed(whole) + meter.close() == whole and meter.tokens == 13
