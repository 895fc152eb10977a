"""`capstan picker` refusing what it must, through ext_proc as Envoy sees it: a pool with no ready pod (503, or the
request sent on anyway when failing open), malformed and oversized bodies, a body that stops arriving, streams that
end early; and it keeps answering afterwards. The replicas here are ports nobody listens on."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from grpc_health.v1 import health_pb2

sys.path.insert(0, str(Path(__file__).parent))

from envoy_client import BUFFERED, EnvoyStream, headers, route  # noqa: E402
from picker_process import free_port, start_picker  # noqa: E402

COMPLETION = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4}).encode()


@pytest.fixture(scope="module")
def dead_replica():
    return f"127.0.0.1:{free_port()}"  # nothing listens: never ready


@pytest.fixture(scope="module")
def picker(dead_replica):
    p = start_picker("--replica", f"http://{dead_replica}", "--body-timeout", "2", "--max-body-bytes", "100000")
    try:
        yield p.wait_ready()
    finally:
        p.stop()


@pytest.fixture
def channel(picker):
    with grpc.insecure_channel(picker.target) as c:
        yield c


def test_health_and_metrics(picker):
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert picker.health(service) == health_pb2.HealthCheckResponse.SERVING
    text = httpx.get(f"{picker.metrics_url}/metrics", timeout=5).text
    assert "capstan_picker_streams_open" in text and "capstan_picker_replica_load" in text


def test_no_ready_replica_is_503_when_failing_closed(channel):
    routed = route(channel, "/v1/completions", COMPLETION)
    assert routed.status == 503 and routed.error["code"] == "no_ready_endpoint"
    headers_set = {h.header.key: h.header.raw_value for h in routed.immediate.headers.set_headers}
    assert headers_set["content-type"] == b"application/json" and headers_set["retry-after"] == b"1"
    assert route(channel, "/v1/models", None).status == 503  # no body: still a replica to find


def test_bad_bodies_get_clear_errors(channel):
    malformed = route(channel, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert malformed.status == 400 and "malformed JSON" in malformed.error["message"]
    assert route(channel, "/v1/completions", b"\xff\xfe").status == 400
    assert route(channel, "/v1/completions", b"[1, 2]").error["message"] == "the request body must be a JSON object"
    no_model = route(channel, "/v1/chat/completions", json.dumps({"messages": []}).encode())
    assert no_model.status == 400 and no_model.error["param"] == "model"
    deep = route(channel, "/v1/completions", b"[" * 100000 + b"]" * 100000, chunk=65536)
    assert deep.status == 413  # over --max-body-bytes before it is parsed at all
    nested = route(channel, "/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert nested.status in (400, 503)  # too deep for json (400), or parsed and then no replica (503)
    buffered = route(channel, "/v1/completions", b"{", mode=BUFFERED)
    assert buffered.replies[0].HasField("request_headers") and buffered.status == 400


def test_oversized_body_is_413_while_it_streams(channel):
    stream = EnvoyStream(channel)
    stream.send(request_headers=headers("/v1/completions"))
    for _ in range(20):  # 20 x 8 KiB = 160 KB > --max-body-bytes 100000: refused at the chunk that passes it
        stream.send(request_body=ext_proc.HttpBody(body=b" " * 8192))
    reply = stream.reply()
    assert reply.immediate_response.status.code == 413
    assert json.loads(reply.immediate_response.body)["error"]["code"] == "request_too_large"
    stream.close()


def test_a_body_that_stops_arriving_is_408(channel):
    stream = EnvoyStream(channel)
    stream.send(request_headers=headers("/v1/completions"))
    stream.send(request_body=ext_proc.HttpBody(body=COMPLETION[:10]))
    started = time.monotonic()
    reply = stream.reply(timeout=10)
    assert reply.immediate_response.status.code == 408 and time.monotonic() - started < 8
    stream.close()


def test_streams_that_end_early_leave_nothing_behind(picker, channel):
    for end in ("close", "cancel"):
        for sent in (0, 1, 2):  # after nothing, the headers, the headers and part of the body
            stream = EnvoyStream(channel)
            if sent:
                stream.send(request_headers=headers("/v1/completions"))
            if sent > 1:
                stream.send(request_body=ext_proc.HttpBody(body=COMPLETION[:10]))
            stream.close() if end == "close" else stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # cancelled streams end on the picker's side a moment later
        text = httpx.get(f"{picker.metrics_url}/metrics", timeout=5).text
        if "capstan_picker_streams_open 0.0" in text:
            break
        time.sleep(0.1)
    assert "capstan_picker_streams_open 0.0" in text
    assert route(channel, "/v1/completions", COMPLETION).status == 503  # still answering
    assert picker.process.poll() is None


def test_fail_open_sends_the_request_on_and_sigterm_stops_it(dead_replica):
    p = start_picker("--replica", f"http://{dead_replica}", "--failure-mode", "FailOpen")
    try:
        p.wait_ready()
        with grpc.insecure_channel(p.target) as channel:
            routed = route(channel, "/v1/completions", COMPLETION)
            assert routed.status is None and routed.endpoint == dead_replica  # the pool's endpoint, unscored
            assert routed.forwarded_body() == (COMPLETION, True)
            assert route(channel, "/v1/completions", b"{").status == 400  # bad input is refused all the same
            whole = b'{"model": "tiny", "prompt": "' + b"a" * (4 << 20) + b'"}'  # over 4 MiB, in one BUFFERED message
            assert route(channel, "/v1/completions", whole, mode=BUFFERED).status == 413
        p.process.send_signal(signal.SIGTERM)  # as the kubelet stops a pod: health NOT_SERVING, then a clean exit
        assert p.process.wait(15) == 0
    finally:
        p.stop()
