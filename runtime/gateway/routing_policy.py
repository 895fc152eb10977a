"""Which replica gets a request: prefix affinity with bounded load, or round robin. Pure; no I/O.

Prefix affinity is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018): every
replica sits at many points of a hash ring; a request's routing key (the leading characters of its prompt or
chat) hashes to a point, and the request goes to the first replica clockwise whose load is under the bound
ceil(c * (total load + 1) / replicas). Requests that share a prefix so meet the replica that has it cached;
a hot prefix spills to the next replica on the ring (the same one every time, so the spill is cached too)
rather than to a random one; and no replica is ever given more than the bound.

KV-event routing knows instead of guessing: replicas publish which KV pages they hold (kv_subscriber.py), and a
request goes to the replica under the same bound that holds the longest run of its prompt's leading pages. Where
that is unknown (no exact scores, a replica whose picture is not trusted, or no replica holds any page) it routes
as prefix affinity does.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Any, Protocol

DEFAULT_PREFIX_CHARS = 128  # long enough to cover a system prompt's identity, short enough to be shared
DEFAULT_LOAD_FACTOR = 1.25  # c: a replica may carry 25% more than the mean before requests spill
VIRTUAL_NODES = 100  # points per replica on the ring: keys spread within a few percent of even
KV_CACHE_FULL = 0.95  # a replica this full would preempt: treat it as over the bound


@dataclass(frozen=True)
class ReplicaLoad:
    """What the policy knows of one ready replica."""

    url: str
    load: float  # requests in flight or queued there
    kv_cache_usage: float = 0.0


class RoutingPolicy(Protocol):
    name: str

    def choose(self, key: str, replicas: list[ReplicaLoad], scores: dict[str, int] | None = None) -> ReplicaLoad | None:
        """The replica for a request with this routing key, among ready ones; None when there are none. scores:
        each replica's cached leading pages of the prompt, by URL, where known (KVEventSubscriber.scores)."""


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def load_bound(total_load: float, replicas: int, factor: float) -> int:
    """The most requests a replica may hold after taking one more, so that none exceeds c x the mean."""
    return math.ceil(factor * (total_load + 1) / replicas)


class HashRing:
    """Replicas at VIRTUAL_NODES points each; `walk(key)` yields every replica once, clockwise from the key."""

    def __init__(self, urls: list[str], virtual_nodes: int = VIRTUAL_NODES):
        points = sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]
        self.size = len(set(urls))

    def walk(self, key: str):
        if not self._urls:
            return
        start = bisect.bisect(self._hashes, _hash(key)) % len(self._urls)
        seen: set[str] = set()
        for url in itertools.chain(self._urls[start:], self._urls[:start]):
            if url not in seen:
                seen.add(url)
                yield url
                if len(seen) == self.size:
                    return


class PrefixAffinityPolicy:
    name = "prefix"

    def __init__(self, load_factor: float = DEFAULT_LOAD_FACTOR):
        assert load_factor >= 1.0, "a bound under the mean could refuse every replica"
        self.load_factor = load_factor
        self._ring: HashRing | None = None
        self._ring_urls: tuple[str, ...] = ()

    def _ring_for(self, urls: list[str]) -> HashRing:
        key = tuple(sorted(urls))
        if key != self._ring_urls:  # membership changed: only the keys of the changed replicas move
            self._ring, self._ring_urls = HashRing(list(key)), key
        assert self._ring is not None
        return self._ring

    def choose(self, key: str, replicas: list[ReplicaLoad], scores: dict[str, int] | None = None) -> ReplicaLoad | None:
        if not replicas:
            return None
        by_url = {r.url: r for r in replicas}
        bound = load_bound(sum(r.load for r in replicas), len(replicas), self.load_factor)
        ring = self._ring_for(list(by_url))
        for url in ring.walk(key):
            replica = by_url[url]
            if replica.load + 1 <= bound and replica.kv_cache_usage < KV_CACHE_FULL:
                return replica
        return min(replicas, key=lambda r: (r.kv_cache_usage >= KV_CACHE_FULL, r.load))  # all full: least loaded


class RoundRobinPolicy:
    """What a Kubernetes Service does, near enough: each replica in turn, blind to prefixes and load."""

    name = "round-robin"

    def __init__(self):
        self._next = 0

    def choose(self, key: str, replicas: list[ReplicaLoad], scores: dict[str, int] | None = None) -> ReplicaLoad | None:
        if not replicas:
            return None
        ordered = sorted(replicas, key=lambda r: r.url)
        replica = ordered[self._next % len(ordered)]
        self._next += 1
        return replica


class KVEventPolicy(PrefixAffinityPolicy):
    """The replica under the load bound with the most of the prompt's leading pages cached (ties: the one prefix
    affinity would pick first); prefix affinity's choice when any such replica's score is unknown or none has one."""

    name = "kv-events"

    def choose(self, key: str, replicas: list[ReplicaLoad], scores: dict[str, int] | None = None) -> ReplicaLoad | None:
        if not replicas or not scores:
            return super().choose(key, replicas)
        bound = load_bound(sum(r.load for r in replicas), len(replicas), self.load_factor)
        eligible = {r.url: r for r in replicas if r.load + 1 <= bound and r.kv_cache_usage < KV_CACHE_FULL}
        if not eligible or any(url not in scores for url in eligible):
            return super().choose(key, replicas)
        best = max(scores[url] for url in eligible)
        if best == 0:
            return super().choose(key, replicas)
        for url in self._ring_for([r.url for r in replicas]).walk(key):
            if url in eligible and scores[url] == best:
                return eligible[url]
        raise AssertionError("the ring walks every replica")


POLICIES = {
    PrefixAffinityPolicy.name: PrefixAffinityPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    KVEventPolicy.name: KVEventPolicy,
}


def _content_text(content: Any) -> str:
    """A chat message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def routing_key(body: dict[str, Any], prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str:
    """The leading characters of what the replica will prefill: the prompt, or the chat messages in order (a
    Responses API request's `instructions`, then its `input`: a string, or items read as messages)."""
    model = str(body.get("model", ""))
    messages = body.get("messages")
    if isinstance(body.get("instructions"), str) or (
        isinstance(body.get("input"), list) and any(isinstance(item, dict) for item in body["input"])
    ):
        conversation = (
            body["input"] if isinstance(body.get("input"), list) else [{"role": "user", "content": body.get("input")}]
        )
        instructions = body.get("instructions")
        messages = [
            *([{"role": "system", "content": instructions}] if isinstance(instructions, str) else []),
            *conversation,
        ]
    if isinstance(messages, list):
        text = ""
        for message in messages:
            if isinstance(message, dict):
                text += f"<{message.get('role', '')}>" + _content_text(message.get("content"))
            if len(text) >= prefix_chars:
                break
    else:
        prompt = body.get("prompt", body.get("input", ""))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt (a list of token ids keys by its leading ids)
        text = (
            prompt
            if isinstance(prompt, str)
            else ",".join(map(str, prompt[:prefix_chars]))
            if isinstance(prompt, list)
            else ""
        )
    return f"{model}\x00{text[:prefix_chars]}"
