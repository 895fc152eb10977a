"""KV events end to end with real parts: two `capstan serve` replicas publishing their prefix caches' events over
ZeroMQ (--kv-events-config), read here by a msgspec decoder of vLLM's shape, and `capstan gateway --routing
kv-events` routing by them: a repeated long prompt goes to the replica that holds its pages even where prompt hashing
would send it elsewhere, and a replica whose stream has a gap nobody can fill is routed by hashing again."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from processes import free_port, metric, ready_all, start_gateway, start_replica  # noqa: E402
from test_kv_events import BlockRemoved, BlockStored, vllm_decode  # noqa: E402  (vLLM's shape, declared there)

from capstan.runtime.gateway.routing_policy import PrefixAffinityPolicy, ReplicaLoad, routing_key  # noqa: E402
from capstan.runtime.kv.page_pool import chained_page_hashes  # noqa: E402

pytestmark = pytest.mark.slow
PAGES = "48"  # 768 tokens a replica: three ~300-token prompts evict the first
WAIT = 10.0  # seconds any one wait may take


def events_config(port: int, replay: int, buffer_steps: int = 10_000) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "buffer_steps": buffer_steps,
        "topic": "kv-events",
    }
    return ["--kv-events-config", json.dumps(config), "--num-pages", PAGES]


def replica_with_events(buffer_steps: int = 10_000):
    """A replica publishing on two ports chosen now (its events_port is the first)."""
    port, replay = free_port(), free_port()
    replica = start_replica("tiny", extra=events_config(port, replay, buffer_steps))
    replica.events_port = port  # read by the tests
    return replica


@pytest.fixture(scope="module")
def replicas():
    # b keeps one batch for replay: a subscriber that joins once it has served cannot catch up (a gap)
    ready = ready_all([replica_with_events, lambda: replica_with_events(buffer_steps=1)])
    try:
        yield ready
    finally:
        for r in ready:
            r.stop()


@pytest.fixture(scope="module")
def gateway(replicas):
    """Started before any request: both replicas' batch 0 is still kept, so it joins both streams in step."""
    g = start_gateway([f"tiny={r.url}" for r in replicas], "--routing", "kv-events", "--poll-interval", "0.25")
    try:
        yield g.wait_ready(30)
    finally:
        g.stop()


def prompt(n: int) -> str:
    return f"Document {n}: " + " ".join(f"word{n}x{i}" for i in range(60))


def complete(url: str, text: str) -> None:
    body = {"model": "tiny", "prompt": text, "max_tokens": 2, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()


def prompts_hashing_sends_to(target: str, replicas) -> list[str]:
    policy, loads = PrefixAffinityPolicy(), [ReplicaLoad(r.url, 0) for r in replicas]
    texts = (prompt(n) for n in range(1000, 1100))
    return [
        t
        for t in texts
        if getattr(policy.choose(routing_key({"model": "tiny", "prompt": t}), loads), "url", None) == target
    ]


def routed(gateway, replica) -> float:
    return metric(gateway.url, "capstan_gateway_routed_total", replica=replica.url)


def test_a_requests_pages_are_published_and_their_eviction_too(replicas, gateway):
    a = replicas[0]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{a.events_port}")
    try:
        time.sleep(0.3)  # the subscription reaches the replica
        text = prompt(1)
        tokens = httpx.post(f"{a.url}/tokenize", json={"model": "tiny", "prompt": text}, timeout=10).json()["tokens"]
        expected = chained_page_hashes(None, tokens, 16)  # what the gateway computes: the replica's own names
        complete(a.url, text)
        stored, removed, last = [], [], None
        deadline = time.monotonic() + WAIT
        while not set(expected) <= set(stored) and time.monotonic() < deadline:
            if sub.poll(500):
                _, sequence, payload = sub.recv_multipart()
                number = int.from_bytes(sequence, "big")
                assert last is None or number == last + 1, "consecutive sequence numbers"
                last = number
                for event in vllm_decode(payload).events:
                    if isinstance(event, BlockStored):
                        assert event.block_size == 16 and len(event.token_ids) == 16 * len(event.block_hashes)
                        stored += event.block_hashes
        assert stored[: len(expected)] == expected, "the prompt's full pages, in order, named as the gateway names them"
        for n in (2, 3, 4):  # 48 pages: these push the first prompt's pages out
            complete(a.url, prompt(n))
        deadline = time.monotonic() + WAIT
        while not set(expected) <= set(removed) and time.monotonic() < deadline:
            if sub.poll(500):
                for event in vllm_decode(sub.recv_multipart()[2]).events:
                    if isinstance(event, BlockRemoved):
                        removed += event.block_hashes
        assert set(expected) <= set(removed), "evicted pages are published as removed"
    finally:
        sub.close()
        context.term()


def test_a_repeated_long_prompt_goes_to_the_replica_that_holds_it(replicas, gateway):
    a, b = replicas
    text = prompts_hashing_sends_to(a.url, replicas)[0]  # hashing would send it to a
    complete(b.url, text)  # but b computed it
    time.sleep(0.5)  # its events reach the gateway
    before = {r.url: routed(gateway, r) for r in replicas}
    hits = metric(b.url, "capstan_prefix_cache_hit_tokens_total")
    complete(gateway.url, text)
    assert routed(gateway, b) - before[b.url] == 1 and routed(gateway, a) == before[a.url]
    assert metric(b.url, "capstan_prefix_cache_hit_tokens_total") - hits >= 16 * 5, "found cached there"


def test_a_gap_nobody_can_fill_falls_back_to_hashing(replicas):
    a, b = replicas
    complete(b.url, prompt(5))  # b has published past what its one-batch replay buffer keeps
    late = start_gateway(
        [f"tiny={r.url}" for r in replicas],
        "--routing",
        "kv-events",
        "--poll-interval",
        "0.25",
        "--kv-events-resync",
        "60",
    )
    try:
        late.wait_ready(30)
        text = prompts_hashing_sends_to(a.url, replicas)[1]
        complete(b.url, text)  # b holds it; this batch reaches the late gateway after a gap
        time.sleep(0.5)
        complete(late.url, text)
        assert routed(late, a) == 1 and routed(late, b) == 0, "b's picture is not trusted: hashing picks a"
    finally:
        late.stop()
