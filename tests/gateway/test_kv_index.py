"""The gateway's picture of each replica's KV pages (kv_index.py) and the policy that routes by it: batches applied
in order, gaps filled by a replay or else the picture dropped and the replica left to prompt hashing for a while,
a restarted replica starting over, and the longest cached prefix winning only under the load bound."""

from __future__ import annotations

from capstan.runtime.gateway.kv_index import EventStream, KVEventIndex
from capstan.runtime.gateway.kv_prompt import page_hashes, tokenize_body
from capstan.runtime.gateway.routing_policy import KVEventPolicy, PrefixAffinityPolicy, ReplicaLoad
from capstan.runtime.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

TOKENS = list(range(100, 164))  # four pages of 16
HASHES = page_hashes(TOKENS, {16})[16]


def stored(*hashes: bytes) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(list(hashes), None, [], 16)])


def removed(*hashes: bytes) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockRemoved(list(hashes))])


CLEARED = KVEventBatch(0.0, [AllBlocksCleared()])


def test_batches_in_order_build_the_picture_and_score_the_longest_leading_run():
    index = KVEventIndex(resync_seconds=5)
    a, b = index.track("http://a", ["tcp://a:1"], 16)[0], index.track("http://b", ["tcp://b:1"], 16)[0]
    assert a.receive(0, CLEARED, now=0) and a.receive(1, stored(*HASHES), now=0)
    assert b.receive(0, CLEARED, now=0) and b.receive(1, stored(HASHES[0], HASHES[2]), now=0)
    assert index.match(["http://a", "http://b"], {16: HASHES}) == {"http://a": 4, "http://b": 1}
    assert a.receive(2, removed(HASHES[1]), now=0)
    assert index.match(["http://a"], {16: HASHES}) == {"http://a": 1}


def test_a_gap_that_no_replay_fills_drops_the_picture_and_hashing_routes_for_a_while():
    index = KVEventIndex(resync_seconds=5)
    stream = index.track("http://a", ["tcp://a:1"], 16)[0]
    stream.receive(0, CLEARED, now=0)
    stream.receive(1, stored(*HASHES), now=0)
    assert not stream.receive(3, removed(HASHES[3]), now=1), "batch 2 is missing: a gap"
    assert not stream.replayed([(3, removed(HASHES[3]))], now=1), "the replay no longer has batch 2"
    stream.lose(now=1, resync_seconds=5)
    stream.resume(3, stored(HASHES[0]))
    assert stream.blocks == {HASHES[0]}, "only what came after the gap: never a page it may have evicted"
    assert not index.trusted("http://a", now=3) and index.trusted("http://a", now=6.5)
    assert stream.receive(4, stored(HASHES[1]), now=7) and stream.expected == 5


def test_a_replay_that_covers_the_gap_keeps_the_stream_in_step():
    stream = EventStream("tcp://a:1")
    stream.receive(0, CLEARED, now=0)
    assert not stream.receive(3, stored(HASHES[2]), now=0)
    assert stream.replayed([(1, stored(HASHES[0])), (2, stored(HASHES[1])), (3, stored(HASHES[2]))], now=0)
    assert stream.receive(3, stored(HASHES[2]), now=0), "the live copy of a replayed batch is skipped"
    assert stream.blocks == set(HASHES[:3]) and stream.trusted(now=0)


def test_a_late_joiner_is_in_step_only_from_a_replay_of_batch_zero():
    stream = EventStream("tcp://a:1")
    assert not stream.receive(5, stored(HASHES[0]), now=0) and not stream.trusted(now=100)
    assert stream.replayed([(0, CLEARED), (1, stored(HASHES[0]))], now=0)
    assert stream.expected == 2 and stream.trusted(now=0)
    late = EventStream("tcp://b:1")
    assert not late.replayed([(4, stored(HASHES[0]))], now=0), "the replica no longer keeps batch 0"


def test_a_restarted_replica_starts_over_from_batch_zero():
    stream = EventStream("tcp://a:1")
    stream.receive(0, CLEARED, now=0)
    stream.receive(1, stored(*HASHES), now=0)
    assert stream.receive(0, CLEARED, now=1) and stream.blocks == set() and stream.trusted(now=1)


def test_the_policy_takes_the_longest_cached_prefix_under_the_bound_else_the_ring():
    policy, ring = KVEventPolicy(1.25), PrefixAffinityPolicy(1.25)
    replicas = [ReplicaLoad("http://a", 0), ReplicaLoad("http://b", 0), ReplicaLoad("http://c", 0)]
    key = "model\0some prompt"
    hashed = ring.choose(key, replicas)
    other = next(r for r in replicas if r != hashed)
    assert policy.choose(key, replicas, {r.url: (5 if r == other else 1) for r in replicas}) == other
    assert policy.choose(key, replicas, None) == hashed
    assert policy.choose(key, replicas, {r.url: 0 for r in replicas}) == hashed, "nothing cached: the ring"
    partial = {r.url: 5 for r in replicas if r == other}  # the others' pictures are not trusted
    assert policy.choose(key, replicas, partial) == hashed
    busy = [ReplicaLoad(r.url, 6 if r == other else 0) for r in replicas]  # over ceil(1.25 * 7 / 3) = 3
    assert policy.choose(key, busy, {r.url: (5 if r == other else 1) for r in replicas}) != other


def test_only_prompts_the_gateway_can_name_exactly_are_tokenized():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert tokenize_body("/v1/chat/completions", chat) == {"messages": chat["messages"], "add_generation_prompt": True}
    assert tokenize_body("/v1/completions", {"prompt": "hello"}) == {"prompt": "hello"}
    assert tokenize_body("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokenize_body("/v1/completions", {"prompt": ["a", "b"]}) is None, "a batch of prompts"
    assert tokenize_body("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}) is None
    assert tokenize_body("/v1/responses", {"input": "hi"}) is None
