"""KVEventPublisher: the engine core's ZeroMQ PUB socket for its prefix cache's events (kv_events.py), in vLLM's
framing: [topic, 8-byte big-endian sequence number, msgpack KVEventBatch].

It never slows the step: `publish` encodes the step's batch (microseconds) and hands it to ZeroMQ without blocking.
A subscriber that reads too slowly fills its queue (hwm batches); then the batch is dropped and counted, and its
sequence number is spent anyway, so every subscriber sees the gap and knows its picture is incomplete. An optional
ROUTER (replay_endpoint, vLLM's) answers a start sequence number with the batches kept since (the last buffer_steps),
then an end marker (sequence -1, empty payload), from a thread of its own that only reads the kept bytes."""

from __future__ import annotations

import collections
import logging
import threading

import zmq

from .kv_events import KVEventBatch, KVEventLog, KVEventsConfig, binds, encode_batch, endpoint_of_core

log = logging.getLogger("capstan.engine")
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_POLL_MS = 200  # how often the replay thread looks whether it should stop


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, log_: KVEventLog, rank: int = 0, context: zmq.Context | None = None):
        self.log = log_
        self.rank = rank
        self.topic = config.topic.encode()
        self.sequence = 0  # the next batch's number; spent by dropped batches too
        self.dropped = 0  # batches lost: a full subscriber queue or a step past max_queue_size events
        self._context = context or zmq.Context.instance()
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self.endpoint = endpoint_of_core(config.endpoint, rank)
        assert self.endpoint is not None, "the config always names an endpoint"
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)  # a full queue refuses the send (counted) instead of losing silently
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
        except zmq.ZMQError:  # (a port in use): the socket must not outlive the failure, or the context never ends
            self._pub.close(linger=0)
            raise
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        self.replay_endpoint = endpoint_of_core(config.replay_endpoint, rank)
        if self.replay_endpoint is not None:
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(self.replay_endpoint)
            except zmq.ZMQError:
                router.close(linger=0)
                self._pub.close(linger=0)
                raise
            self._replay_thread = threading.Thread(
                target=self._serve_replays, args=(router,), name="capstan-kv-events-replay", daemon=True
            )
            self._replay_thread.start()
        log_.cleared()  # the first batch says the cache starts empty (a restarted replica's subscribers reset)
        self.publish()
        log.info("publishing KV events on %s (topic %r)", self.endpoint, config.topic)

    def publish(self) -> None:
        """Sends the events recorded since the last call, if any, as one batch; never blocks."""
        if self.log.take_overflow():
            self.sequence += 1  # spent: subscribers see the gap
            self._drop("its step recorded more than max_queue_size events")
            return
        batch = self.log.take(self.rank)
        if batch is None:
            return
        self.send(batch)

    def send(self, batch: KVEventBatch) -> None:
        sequence = self.sequence
        self.sequence += 1
        payload = encode_batch(batch)
        self._kept.append((sequence, payload))
        try:
            self._pub.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._drop("a subscriber's queue is full")

    def _drop(self, why: str) -> None:
        if self.dropped == 0 or self.dropped % 1000 == 0:
            log.warning("KV event batch dropped (%d so far): %s", self.dropped + 1, why)
        self.dropped += 1

    def _serve_replays(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(REPLAY_POLL_MS):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request: [identity, empty, 8-byte start]
                client, _, start = frames
                first = int.from_bytes(start, "big")
                for sequence, payload in list(self._kept):  # (a copy: the engine appends meanwhile)
                    if sequence >= first:
                        router.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
                router.send_multipart((client, b"", END_OF_REPLAY, b""))
        except zmq.ZMQError as e:  # closed under it at shutdown
            log.debug("KV event replay stopped: %s", e)
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2 * REPLAY_POLL_MS / 1000)
        self._pub.close(linger=0)
