"""`capstan picker` choosing among two real `capstan serve` replicas (replica 1 also serves the LoRA adapter `chat`),
driven as Envoy drives it: each request streamed through ext_proc, then sent where the picker said, its response
streamed back through the same ext_proc stream. The picker picks by model and adapter (each replica's /v1/models),
keeps a prompt prefix on one replica, spills to the other under load, honours the Gateway's subset hint, and answers
unknown models 404 in OpenAI's shape."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from envoy_client import BUFFERED, EnvoyStream, Mode, Routed, headers, route, subset_metadata  # noqa: E402
from lora_adapters import write_adapter  # noqa: E402
from picker_process import start_picker  # noqa: E402
from processes import free_port, metric, start_replica  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL  # noqa: E402
from capstan.runtime.gateway.routing_policy import PrefixAffinityPolicy, ReplicaLoad, routing_key  # noqa: E402

pytestmark = pytest.mark.slow
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
JSON = {"content-type": "application/json"}
SYSTEM = "You are Capstan's test assistant. Answer briefly and never repeat the question back. " * 2


def completion(prompt: str, model: str = "tiny", **fields) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}).encode()


def chat(question: str, model: str = "tiny") -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return json.dumps({"model": model, "messages": messages, "max_tokens": 3}).encode()


def kv_events_flags() -> list[str]:
    """Publish the prefix cache's KV events (kept for replay, so a subscriber that joins late catches up)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events", "buffer_steps": 10_000}
    config |= {"endpoint": f"tcp://*:{free_port()}", "replay_endpoint": f"tcp://*:{free_port()}"}
    return ["--kv-events-config", json.dumps(config)]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    adapter = write_adapter(tmp_path_factory.mktemp("adapters") / "chat", DEFAULT_MODEL, seed=1, rank=4)
    started = [
        start_replica("tiny", extra=kv_events_flags()),
        start_replica("tiny", extra=[*kv_events_flags(), *LORA_FLAGS, "--lora-modules", f"chat={adapter}"]),
    ]
    try:
        yield [r.wait_ready() for r in started]
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="module")
def endpoints(replicas):
    return [r.url.removeprefix("http://") for r in replicas]


@pytest.fixture(scope="module")
def picker(replicas):
    p = start_picker(*[f for r in replicas for f in ("--replica", r.url)])
    try:
        yield p.wait_ready()
    finally:
        p.stop()


@pytest.fixture
def channel(picker):
    with grpc.insecure_channel(picker.target) as c:
        yield c


def relay(stream: EnvoyStream, endpoint: str, path: str, body: bytes) -> tuple[int, bytes]:
    """What Envoy does once the picker answered: send the request to `endpoint`, and stream the response through the
    ext_proc stream (headers, then body chunks); the picker must hand every byte back unchanged."""
    relayed = b""
    with httpx.stream("POST", f"http://{endpoint}{path}", content=body, headers=JSON, timeout=60) as response:
        served = base_pb2.Metadata()
        served.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": endpoint})
        header_map = [base_pb2.HeaderValue(key=":status", raw_value=str(response.status_code).encode())]
        header_map += [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in response.headers.items()]
        stream.send(
            response_headers=ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=header_map)),
            metadata_context=served,
        )
        assert stream.reply().HasField("response_headers")
        for chunk in response.iter_raw():
            stream.send(response_body=ext_proc.HttpBody(body=chunk))
            relayed += stream.reply().response_body.response.body_mutation.streamed_response.body
        stream.send(response_body=ext_proc.HttpBody(body=b"", end_of_stream=True))
        assert stream.reply().response_body.response.body_mutation.streamed_response.end_of_stream
        return response.status_code, relayed


def test_a_request_goes_where_the_picker_says_and_its_response_streams_back(channel, endpoints):
    for path, body in [
        ("/v1/completions", completion("Once upon a time")),
        ("/v1/chat/completions", json.dumps({**json.loads(chat("Hello")), "stream": True}).encode()),
    ]:
        stream = EnvoyStream(channel)
        routed = route(channel, path, body, chunk=17, stream=stream)  # small chunks: the body comes in many pieces
        assert routed.endpoint in endpoints and len(routed.destination.split(",")) == 2  # a fallback for retries
        assert routed.replies[0].HasField("request_headers")  # the headers' answer first, then the body's
        assert routed.forwarded_body() == (body, True)
        status, relayed = relay(stream, routed.endpoint, path, body)
        stream.close()
        assert status == 200
        if b"data: " in relayed:
            assert relayed.rstrip().endswith(b"data: [DONE]")
        else:
            assert json.loads(relayed)["object"] == "text_completion"


def test_models_and_adapters_pick_replicas_that_serve_them(channel, endpoints):
    assert {route(channel, "/v1/completions", completion(f"chat {i}", "chat")).endpoint for i in range(6)} == {
        endpoints[1]
    }
    assert route(channel, "/v1/models", None).endpoint in endpoints  # no body: any ready replica
    missing = route(channel, "/v1/completions", completion("hi", "no-such-model"))
    assert missing.status == 404 and missing.error["code"] == "model_not_found" and missing.error["param"] == "model"
    no_body_sent = EnvoyStream(channel, request_mode=Mode.NONE)  # Envoy keeps the body: pick at the headers
    no_body_sent.send(request_headers=headers("/v1/completions"))
    assert Routed([no_body_sent.reply()]).endpoint in endpoints
    no_body_sent.close()
    buffered = route(channel, "/v1/completions", completion("hi", "chat"), mode=BUFFERED)
    assert buffered.replies[0].request_headers == ext_proc.HeadersResponse()  # answered at once, unchanged
    assert buffered.endpoint == endpoints[1] and buffered.mutation_reply().HasField("request_body")


def test_a_shared_prefix_keeps_its_replica_until_load_spills_it(channel, endpoints, picker):
    picked = {route(channel, "/v1/chat/completions", chat(f"question {i}")).endpoint for i in range(6)}
    assert len(picked) == 1  # one system prompt: one replica, whose prefix cache has it
    # Requests in flight (their streams open, responses pending) are load: the third spills to the other replica.
    streams = [EnvoyStream(channel) for _ in range(3)]
    try:
        spread = [route(channel, "/v1/chat/completions", chat("held"), stream=s).endpoint for s in streams]
        assert spread[:2] == [*picked, *picked] and spread[2] != spread[0]
        loads = {e: metric(picker.metrics_url, "capstan_picker_replica_load", endpoint=e) for e in endpoints}
        assert loads[spread[0]] >= 2 and loads[spread[2]] >= 1
    finally:
        for s in streams:
            s.close()


def test_the_subset_hint_limits_the_choice(channel, endpoints):
    only_first = subset_metadata([endpoints[0]])
    assert {route(channel, "/v1/completions", completion(f"p{i}"), metadata=only_first).endpoint for i in range(5)} == {
        endpoints[0]
    }
    assert route(channel, "/v1/completions", completion("hi", "chat"), metadata=only_first).status == 503
    assert route(channel, "/v1/completions", completion("hi"), metadata=subset_metadata(["10.9.9.9:1"])).status == 503


def test_kv_events_pick_the_replica_that_holds_the_prompts_pages(replicas, endpoints):
    """With --routing kv-events a prompt goes where its KV pages are, even where prompt hashing points elsewhere."""
    policy, loads = PrefixAffinityPolicy(), [ReplicaLoad(r.url, 0) for r in replicas]
    texts = (f"Document {n}: " + " ".join(f"word{n}x{i}" for i in range(60)) for n in range(100))
    text = next(
        t for t in texts if policy.choose(routing_key({"model": "tiny", "prompt": t}), loads).url == replicas[0].url
    )
    p = start_picker(*[f for r in replicas for f in ("--replica", r.url)], "--routing", "kv-events")
    try:
        p.wait_ready()
        with grpc.insecure_channel(p.target) as channel:
            assert route(channel, "/v1/completions", completion(text)).endpoint == endpoints[0]  # no pages: hashing
            reply = httpx.post(f"{replicas[1].url}/v1/completions", content=completion(text), headers=JSON, timeout=60)
            reply.raise_for_status()  # replica 1 now holds the prompt's pages, and publishes that
            deadline = time.monotonic() + 20
            while (picked := route(channel, "/v1/completions", completion(text)).endpoint) != endpoints[1]:
                assert time.monotonic() < deadline, f"still picked {picked}: the events never counted"
                time.sleep(0.25)
    finally:
        p.stop()
