"""The gateway's subscriber on real ZeroMQ sockets against the engine core's real publisher (no serving process):
a late joiner catches up from the replay socket, a batch lost beyond what the replica keeps leaves the replica
untrusted, and a replica that restarts on the same ports is followed again from its batch 0."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import zmq

from capstan.runtime.gateway.kv_index import EventStream, KVEventIndex
from capstan.runtime.gateway.kv_subscriber import KVEventSubscriber
from capstan.runtime.kv.kv_event_publisher import KVEventPublisher
from capstan.runtime.kv.kv_events import KVEventLog, KVEventsConfig

sys.path.insert(0, str(Path(__file__).parent))
from processes import free_port  # noqa: E402

TIMEOUT = 5.0  # seconds any one wait may take


def h(n: int) -> bytes:
    return n.to_bytes(16, "big")


def start_publisher(context: zmq.Context, port: int, replay: int) -> tuple[KVEventPublisher, KVEventLog]:
    config = KVEventsConfig(True, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}", max_queue_size=2)
    log = KVEventLog(16, config.max_queue_size)
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return KVEventPublisher(config, log, 0, context), log
        except zmq.ZMQError:  # the ports of the publisher just closed are released in the background
            assert time.monotonic() < deadline, f"ports {port}, {replay} still in use after {TIMEOUT} s"
            time.sleep(0.05)


def publish(publisher: KVEventPublisher, log: KVEventLog, *pages: int) -> None:
    for page in pages:
        log.stored(h(page), None, [page])
    publisher.publish()


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"not within {TIMEOUT} s: {what}"
        await asyncio.sleep(0.02)


def test_late_join_a_lost_batch_and_a_restarted_replica():
    port, replay = free_port(), free_port()
    context = zmq.Context()
    publisher, log = start_publisher(context, port, replay)
    publish(publisher, log, 1)
    publish(publisher, log, 2)  # before anyone subscribes

    async def follow() -> None:
        pool = SimpleNamespace(replicas={}, poll_interval=0.1, card=lambda model: None)
        subscriber = KVEventSubscriber(pool, KVEventIndex(resync_seconds=60))  # type: ignore[arg-type]
        stream: EventStream = subscriber.index.track("http://r", [f"tcp://127.0.0.1:{port}"], 16)[0]
        task = asyncio.create_task(subscriber._stream(stream, b"", f"tcp://127.0.0.1:{replay}"))
        try:
            await until(lambda: stream.trusted(time.monotonic()), "in step from the replay of batch 0")
            assert stream.blocks == {h(1), h(2)}
            publish(publisher, log, 3)
            await until(lambda: h(3) in stream.blocks, "a live batch applied")

            publish(publisher, log, 4, 5, 6)  # past max_queue_size: dropped, its number spent, not kept
            publish(publisher, log, 7)
            await until(lambda: stream.gaps == 1, "the gap seen, and no replay could fill it")
            assert stream.blocks == {h(7)} and not subscriber.index.trusted("http://r")

            live[0].close()  # the replica restarts on the same ports
            restarted, restarted_log = start_publisher(context, port, replay)
            live[0] = restarted
            publish(restarted, restarted_log, 8)
            await until(lambda: stream.blocks == {h(8)} and stream.trusted(time.monotonic()), "followed afresh")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await subscriber.close()

    live = [publisher]  # the publisher running now (the test restarts it)
    try:
        asyncio.run(asyncio.wait_for(follow(), 4 * TIMEOUT))
    finally:
        live[0].close()
        context.term()
