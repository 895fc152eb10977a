"""`capstan gateway` in front of real `capstan serve` replicas, used through the openai client: streaming, routing
by model and by prefix, OpenAI errors for bad input, a retry when a replica dies before the first byte, and a
request sent at zero replicas (or while the only replica restarts) that succeeds once one is ready."""

from __future__ import annotations

import concurrent.futures
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from processes import free_port, metric, start_gateway, start_replica  # noqa: E402

from capstan.runtime.gateway.routing_policy import PrefixAffinityPolicy, ReplicaLoad, routing_key  # noqa: E402

pytestmark = pytest.mark.slow
SYSTEM = "You are Capstan's test assistant. Answer briefly and never repeat the question back. " * 2


@pytest.fixture(scope="module")
def replicas():
    started = [start_replica("tiny"), start_replica("tiny")]
    try:
        yield [r.wait_ready() for r in started]
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="module")
def gateway(replicas):
    g = start_gateway([f"tiny={r.url}" for r in replicas], "--poll-interval", "0.25")
    try:
        yield g.wait_ready(30)
    finally:
        g.stop()


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_streams_chat_completions_and_responses(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and len(chunks) >= 3
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 5
    events = list(client.responses.create(model="tiny", input="Hello", max_output_tokens=4, stream=True))
    assert events[0].type == "response.created" and events[-1].response.usage.output_tokens <= 4


def test_routes_by_model_and_refuses_bad_input(client, gateway):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert missing.value.body["code"] == "model_not_found"
    malformed = httpx.post(f"{gateway.url}/v1/completions", content=b"{not json", timeout=10)
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    no_model = httpx.post(f"{gateway.url}/v1/chat/completions", json={"messages": []}, timeout=10)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    # Errors of the replica's own (a bad field) come back as it sent them.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)


def test_shared_prefix_keeps_its_replica(client, gateway, replicas):
    before = {r.url: metric(gateway.url, "capstan_gateway_routed_total", replica=r.url) for r in replicas}
    for i in range(6):
        client.chat.completions.create(
            model="tiny",
            max_tokens=2,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}"}],
        )
    routed = {
        r.url: metric(gateway.url, "capstan_gateway_routed_total", replica=r.url) - before[r.url] for r in replicas
    }
    assert sorted(routed.values()) == [0, 6], routed  # one at a time, under the bound: all to one replica
    home = max(routed, key=routed.get)
    hits = metric(home, "capstan_prefix_cache_hit_tokens_total")
    assert hits > 0  # the shared system prompt was found cached there


def test_sigterm_drains_in_flight_streams_then_exits(replicas):
    g = start_gateway([f"tiny={r.url}" for r in replicas]).wait_ready(30)
    try:
        client = openai.OpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny", prompt="Drain me", max_tokens=900, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [next(iter(stream))]
        g.process.send_signal(signal.SIGTERM)
        ready = httpx.get(f"{g.url}/ready", timeout=5)
        refused = httpx.post(f"{g.url}/v1/completions", json={"model": "tiny", "prompt": "late"}, timeout=5)
        chunks += list(stream)
        assert ready.status_code == 503 and refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert chunks[-1].choices[0].finish_reason == "length"  # the in-flight stream finished whole
        assert g.process.wait(30) == 0
    finally:
        g.stop()


def test_replica_dying_mid_stream_is_not_retried_and_before_the_first_byte_is(replicas):
    a, b = replicas
    # A slow poller: the gateway still believes the killed replica ready, so its requests must be retried.
    g = start_gateway([f"tiny={a.url}", f"tiny={b.url}"], "--poll-interval", "60").wait_ready(30)
    try:
        policy, loads = PrefixAffinityPolicy(), [ReplicaLoad(a.url, 0), ReplicaLoad(b.url, 0)]
        prompts = [
            p
            for p in (f"Story number {i}: " for i in range(40))
            if policy.choose(routing_key({"model": "tiny", "prompt": p}), loads).url == b.url
        ][:3]
        client = openai.OpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0, timeout=60)
        # A stream that has begun is the client's: when its replica dies, it ends with an error, never re-sent.
        stream = client.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=900, stream=True, extra_body={"ignore_eos": True}
        )
        assert next(iter(stream)).choices
        b.kill()
        with pytest.raises(openai.APIError, match="stopped mid-response"):
            for _ in stream:
                pass
        assert metric(g.url, "capstan_gateway_broken_off_total") == 1
        assert metric(g.url, "capstan_gateway_routed_total", replica=a.url) == 0
        for prompt in prompts:  # each prefers the dead replica
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) is not None
        assert metric(g.url, "capstan_gateway_retries_total", model="tiny") >= 1
        assert metric(g.url, "capstan_gateway_requests_total", model="tiny", code="200") == len(prompts) + 1
    finally:
        g.stop()


def test_request_at_zero_replicas_succeeds_once_one_is_ready():
    port = free_port()
    g = start_gateway([f"cold=http://127.0.0.1:{port}"], "--poll-interval", "0.25", "--hold-timeout", "120")
    g.wait_ready(30)
    replica = None
    client = openai.OpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0, timeout=150)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            sent = [
                pool.submit(client.completions.create, model="cold", prompt=f"Request {i}", max_tokens=3)
                for i in range(3)
            ]
            deadline = time.monotonic() + 20
            while metric(g.url, "capstan_gateway_requests_held") < 3:
                assert time.monotonic() < deadline, "the requests were not held"
                time.sleep(0.2)
            replica = start_replica("cold", port=port)  # the first replica starts after the requests arrived
            answers = [f.result(timeout=150) for f in sent]
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)  # none lost
        assert metric(g.url, "capstan_gateway_requests_held") == 0
        # The only replica restarts: a request sent meanwhile waits for it rather than failing.
        replica.kill()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            during = pool.submit(client.completions.create, model="cold", prompt="During the restart", max_tokens=3)
            replica.stop()
            replica = start_replica("cold", port=port)
            assert during.result(timeout=150).choices[0].finish_reason in ("stop", "length")
        assert metric(g.url, "capstan_gateway_hold_refused_total") == 0
    finally:
        g.stop()
        if replica is not None:
            replica.stop()


def test_hold_queue_is_bounded_in_size_and_time():
    g = start_gateway([f"never=http://127.0.0.1:{free_port()}"], "--hold-timeout", "2", "--max-held", "1").wait_ready(
        30
    )
    try:

        def send():
            return httpx.post(f"{g.url}/v1/completions", json={"model": "never", "prompt": "hi"}, timeout=30)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = pool.submit(send)
            deadline = time.monotonic() + 10
            while metric(g.url, "capstan_gateway_requests_held") < 1:
                assert time.monotonic() < deadline, "the first request was not held"
                time.sleep(0.1)
            full = send()  # the queue holds one: refused at once
            timed_out = held.result(timeout=30)
        for response, says in ((full, "already wait"), (timed_out, "within 2 s")):
            assert response.status_code == 503 and response.headers["retry-after"], response.text
            assert response.json()["error"]["code"] == "no_replica" and says in response.json()["error"]["message"]
        assert metric(g.url, "capstan_gateway_hold_refused_total") == 2
    finally:
        g.stop()


def test_held_request_whose_client_hangs_up_leaves_the_queue():
    g = start_gateway([f"never=http://127.0.0.1:{free_port()}"], "--hold-timeout", "60").wait_ready(30)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{g.url}/v1/completions", json={"model": "never", "prompt": "hi"}, timeout=1)
        deadline = time.monotonic() + 5
        while metric(g.url, "capstan_gateway_requests_held") > 0:
            assert time.monotonic() < deadline, "the abandoned request still holds a place"
            time.sleep(0.1)
    finally:
        g.stop()
