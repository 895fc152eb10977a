"""KV events as a vLLM consumer reads them: the PagePool's pages named and evicted, published over a real ZeroMQ PUB
socket and decoded with msgspec structs written as vLLM declares its own (vllm/distributed/kv_events.py), not with
ours; the sequence numbers, the replay socket, the bound on a step's events and --kv-events-config's checks."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from capstan.runtime.kv.kv_event_publisher import END_OF_REPLAY, KVEventPublisher
from capstan.runtime.kv.kv_events import KVEventLog, KVEventsConfig, endpoint_of_core
from capstan.runtime.kv.page_pool import PagePool, chained_page_hashes


# ---- vLLM's shape, as a consumer built for vLLM declares it -------------------------------------------------------
class VLLMEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VLLMEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(VLLMEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(VLLMEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


vllm_decode = msgspec.msgpack.Decoder(KVEventBatch).decode


def receive(sub: zmq.Socket, timeout_ms: int = 2000) -> tuple[bytes, int, KVEventBatch]:
    assert sub.poll(timeout_ms), "no KV event batch within the timeout"
    topic, sequence, payload = sub.recv_multipart()
    return topic, int.from_bytes(sequence, "big"), vllm_decode(payload)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def publisher_and_subscriber(context, pool: PagePool, **fields) -> tuple[KVEventPublisher, zmq.Socket]:
    endpoint = f"ipc:///tmp/capstan-kv-test-{time.monotonic_ns()}"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, topic="kv@test", **fields)
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
    sub.setsockopt(zmq.LINGER, 0)
    pool.events = KVEventLog(pool.page_size, config.max_queue_size)
    publisher = KVEventPublisher(config, pool.events, 0, context)  # sends AllBlocksCleared as batch 0
    sub.connect(endpoint)
    time.sleep(0.2)  # the subscription reaches the publisher (ZeroMQ's slow joiner)
    return publisher, sub


def test_pages_named_and_evicted_reach_a_vllm_decoder_in_order(context):
    pool = PagePool(num_pages=4, page_size=2)
    publisher, sub = publisher_and_subscriber(context, pool)
    try:
        tokens = [1, 2, 3, 4, 5, 6]
        hashes = chained_page_hashes(None, tokens, 2)
        pages = pool.allocate(3)
        for k, (page, h) in enumerate(zip(pages, hashes, strict=True)):
            assert pool.register(page, h)  # the scheduler records what it named, with its tokens
            pool.events.stored(h, hashes[k - 1] if k else None, tokens[2 * k : 2 * k + 2])
        publisher.publish()
        topic, sequence, batch = receive(sub)
        assert topic == b"kv@test" and sequence == 1 and batch.data_parallel_rank == 0
        (stored,) = batch.events  # one run of consecutive pages: one event, as vLLM sends it
        assert isinstance(stored, BlockStored)
        assert stored.block_hashes == hashes and stored.parent_block_hash is None
        assert stored.token_ids == tokens and stored.block_size == 2 and stored.medium == "GPU"

        pool.release(pages)  # cached, unreferenced: evicted least recently used first
        pool.allocate(4)  # one free page, then the three cached ones
        publisher.publish()
        _, sequence, batch = receive(sub)
        (removed,) = batch.events
        assert sequence == 2 and isinstance(removed, BlockRemoved) and removed.block_hashes == hashes

        publisher.publish()  # nothing happened: nothing sent
        assert not sub.poll(100)
    finally:
        publisher.close()
        sub.close()


def test_a_step_past_the_bound_is_dropped_counted_and_leaves_a_gap(context):
    pool = PagePool(num_pages=8, page_size=1)
    publisher, sub = publisher_and_subscriber(context, pool, max_queue_size=2, replay_endpoint=None)
    try:
        for page in pool.allocate(3):
            pool.events.stored(bytes([page]) * 16, None, [page])  # unchained: three events, past the bound of two
        publisher.publish()
        pool.events.stored(b"x" * 16, None, [9])
        publisher.publish()
        _, sequence, batch = receive(sub)
        assert publisher.dropped == 1 and sequence == 2, "batch 1 was dropped: the subscriber sees 0, then 2"
        assert batch.events[0].block_hashes == [b"x" * 16]
    finally:
        publisher.close()
        sub.close()


def test_a_subscriber_that_stops_reading_never_blocks_the_step(context):
    pool = PagePool(num_pages=8, page_size=1)
    publisher, sub = publisher_and_subscriber(context, pool, hwm=1)
    try:
        sub.setsockopt(zmq.RCVHWM, 1)
        start = time.perf_counter()
        for n in range(5000):  # never read: ZeroMQ's queues fill, then each batch is dropped and counted
            pool.events.stored(n.to_bytes(16, "big"), None, [n])
            publisher.publish()
        assert publisher.dropped > 0 and publisher.sequence == 5001
        assert time.perf_counter() - start < 2.0, "publishing waited on the subscriber"
    finally:
        publisher.close()
        sub.close()


def test_replay_answers_the_kept_batches_from_a_sequence_number(context):
    pool = PagePool(num_pages=8, page_size=1)
    replay = f"ipc:///tmp/capstan-kv-replay-{time.monotonic_ns()}"
    publisher, sub = publisher_and_subscriber(context, pool, replay_endpoint=replay, buffer_steps=3)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for page in range(4):
            pool.events.stored(bytes([page]) * 16, None, [page])
            publisher.publish()  # batches 1..4; batch 0 (the clear) is out of the buffer of 3
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(2000), "the replay did not answer"
            _, sequence, payload = dealer.recv_multipart()
            if sequence == END_OF_REPLAY:
                break
            got.append((int.from_bytes(sequence, "big"), vllm_decode(payload).events[0].block_hashes))
        assert got == [(2, [b"\1" * 16]), (3, [b"\2" * 16]), (4, [b"\3" * 16])]
    finally:
        dealer.close()
        publisher.close()
        sub.close()


def test_the_flag_takes_vllms_json_and_names_what_is_wrong():
    config = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}'
    )
    assert config.publishes and config.endpoint == "tcp://*:5557"
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').publishes
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    with pytest.raises(ValueError, match="unknown field.*endpiont"):
        KVEventsConfig.parse('{"endpiont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="publisher must be one of"):
        KVEventsConfig.parse('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="hwm must be an integer"):
        KVEventsConfig.parse('{"hwm": 0}')
    assert endpoint_of_core("tcp://*:5557", 2) == "tcp://*:5559"  # vLLM's data-parallel ranks


def test_events_without_a_prefix_cache_are_refused_naming_both_flags():
    from capstan.runtime.config import EngineConfig

    config = EngineConfig(enable_prefix_caching=False, kv_events_config=KVEventsConfig(enable_kv_cache_events=True))
    with pytest.raises(ValueError, match="--no-enable-prefix-caching or --kv-events-config"):
        config.validate()


def test_a_run_of_pages_is_one_event_per_adapter():
    log = KVEventLog(page_size=1)
    log.stored(b"a" * 16, None, [1])
    log.stored(b"b" * 16, b"a" * 16, [2])  # chained to the one before: the same event
    log.stored(b"c" * 16, b"b" * 16, [3], lora_id=7)  # another adapter's page: its own event
    batch = log.take(0)
    assert batch is not None and [(e.block_hashes, e.lora_id) for e in batch.events] == [
        ([b"a" * 16, b"b" * 16], None),
        ([b"c" * 16], 7),
    ]
