"""The routing policy on synthetic load: affinity kept under even load, spill under skew, no replica above the
bound, few keys moved when a replica joins."""

from __future__ import annotations

import collections
import random

from capstan.runtime.gateway.routing_policy import (
    KV_CACHE_FULL,
    PrefixAffinityPolicy,
    ReplicaLoad,
    RoundRobinPolicy,
    load_bound,
    routing_key,
)

REPLICAS = [f"http://10.0.0.{i}:8000" for i in range(4)]


def loads(counts: dict[str, float], kv: dict[str, float] | None = None) -> list[ReplicaLoad]:
    return [ReplicaLoad(url, counts.get(url, 0), (kv or {}).get(url, 0.0)) for url in REPLICAS]


def test_affinity_kept_under_even_load():
    policy = PrefixAffinityPolicy()
    keys = [f"system prompt {i}" for i in range(40)]
    first = {key: policy.choose(key, loads({})).url for key in keys}
    # Even, light load: every replica has one request in flight. Every key keeps its replica.
    for _ in range(5):
        for key in keys:
            assert policy.choose(key, loads({url: 1 for url in REPLICAS})).url == first[key]
    spread = collections.Counter(first.values())
    assert len(spread) == len(REPLICAS) and max(spread.values()) <= 20  # keys spread over every replica


def test_hot_prefix_spills_and_no_replica_exceeds_the_bound():
    policy = PrefixAffinityPolicy(load_factor=1.25)
    in_flight: collections.Counter = collections.Counter()
    home = policy.choose("hot", loads({})).url
    rng = random.Random(0)
    for step in range(400):
        key = "hot" if rng.random() < 0.8 else f"cold {rng.randrange(50)}"  # skew: 80% share one prefix
        current = loads(dict(in_flight))
        bound = load_bound(sum(in_flight.values()), len(REPLICAS), 1.25)
        chosen = policy.choose(key, current).url
        in_flight[chosen] += 1
        assert in_flight[chosen] <= bound, f"step {step}: {chosen} holds {in_flight[chosen]} > bound {bound}"
        if step % 3 == 0:  # requests finish more slowly than they arrive: load builds up
            done = rng.choice([u for u in REPLICAS if in_flight[u]])
            in_flight[done] -= 1
    assert in_flight[home] == max(in_flight.values())  # the hot prefix's replica is the busiest, but bounded
    assert all(in_flight[url] > 0 for url in REPLICAS)  # the hot prefix spilled onto the others


def test_spill_goes_to_the_same_next_replica():
    policy = PrefixAffinityPolicy()
    home = policy.choose("hot", loads({})).url
    busy = {home: 10}
    spills = {policy.choose("hot", loads(busy)).url for _ in range(5)}
    assert len(spills) == 1 and home not in spills


def test_full_kv_cache_is_avoided():
    policy = PrefixAffinityPolicy()
    home = policy.choose("k", loads({})).url
    assert policy.choose("k", loads({}, kv={home: KV_CACHE_FULL})).url != home


def test_few_keys_move_when_a_replica_joins():
    policy = PrefixAffinityPolicy()
    three = [r for r in loads({}) if r.url != REPLICAS[3]]
    keys = [f"doc {i}" for i in range(400)]
    before = {k: policy.choose(k, three).url for k in keys}
    after = {k: policy.choose(k, loads({})).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == REPLICAS[3] for k in moved)  # keys only move to the new replica
    assert 0.1 < len(moved) / len(keys) < 0.4  # about a quarter


def test_round_robin_ignores_prefix():
    policy = RoundRobinPolicy()
    assert len({policy.choose("same", loads({})).url for _ in range(4)}) == 4


def test_routing_key_reads_prompt_and_chat_prefix():
    system = "You are a careful assistant. " * 10
    a = routing_key(
        {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "first"}]}
    )
    b = routing_key(
        {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "second"}]}
    )
    assert a == b  # the shared system prompt is the key
    assert routing_key({"model": "m", "prompt": system + "x"}) == routing_key({"model": "m", "prompt": system + "y"})
    assert routing_key({"model": "m", "prompt": "a"}) != routing_key({"model": "other", "prompt": "a"})
    assert routing_key({"model": "m", "prompt": [[1, 2, 3]]}) == routing_key({"model": "m", "prompt": [1, 2, 3]})
    parts = [{"type": "text", "text": "hello"}]
    assert routing_key({"model": "m", "messages": [{"role": "user", "content": parts}]}).endswith("<user>hello")
    # the Responses API: instructions, then the input's items read as messages; a string input is the user's
    chat = routing_key({"model": "m", "messages": [{"role": "system", "content": "be brief"}, *_user("hi")]})
    assert routing_key({"model": "m", "instructions": "be brief", "input": "hi"}) == chat
    assert routing_key({"model": "m", "instructions": "be brief", "input": _user("hi")}) == chat
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert routing_key({"model": "m", "input": items}).endswith("<user>hi")


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
