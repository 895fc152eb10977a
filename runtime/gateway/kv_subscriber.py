"""KVEventSubscriber: follows every ready replica's KV events into a KVEventIndex (kv_index.py), on the gateway's
event loop.

A replica says where it publishes at GET /kv_events (runtime/server/kv_events_info.py): one ZeroMQ endpoint per
engine core (a wildcard host there is the replica's own host, as its URL names it), its replay endpoints, topic,
page size and hash scheme. The subscriber connects a SUB socket to each (ZeroMQ heartbeats find a peer that went
silent; its monitor reports disconnects), applies batches in order, and on a gap asks the replay endpoint for the
batches it missed; what cannot be filled makes that stream lose its picture (the index then leaves the replica out
of scoring for a while). A replica that stops being ready keeps its streams; one that leaves the pool is dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..kv.kv_events import KVEventBatch, decode_batch
from ..kv.page_pool import HASH_SCHEME
from .kv_index import EventStream, KVEventIndex
from .kv_prompt import page_hashes, prompt_token_ids
from .replica_pool import ReplicaPool

log = logging.getLogger("capstan.gateway")
ADVERT_RETRY_SECONDS = 10.0  # a replica without KV events (or unreachable) is asked again after this
REPLAY_TIMEOUT_SECONDS = 2.0
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 1000, 3000
END_OF_REPLAY = -1
WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def reachable_endpoint(endpoint: str, replica_url: str) -> str | None:
    """The replica's advertised endpoint as the gateway connects to it: a bound wildcard becomes the replica's
    host; an endpoint the replica connects out to (it has no listener) is none."""
    if endpoint.startswith("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if host not in WILDCARD_HOSTS:
        return None  # connect mode: the replica pushes to a subscriber that binds (llm-d's indexer)
    replica_host = urlsplit(replica_url).hostname or "127.0.0.1"
    return f"tcp://[{replica_host}]:{port}" if ":" in replica_host else f"tcp://{replica_host}:{port}"


class KVEventSubscriber:
    def __init__(self, pool: ReplicaPool, index: KVEventIndex | None = None):
        self.pool = pool
        self.index = index or KVEventIndex()
        self.context = zmq.asyncio.Context()
        self._client = httpx.AsyncClient(timeout=2.0)
        self._followers: dict[str, list[asyncio.Task]] = {}
        self._asked: dict[str, float] = {}  # replica -> when its /kv_events was last read without result

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.refresh()
                except Exception:  # noqa: BLE001 - the next round retries; routing falls back to hashing meanwhile
                    log.exception("following the replicas' KV events failed this round")
                await asyncio.sleep(self.pool.poll_interval)
        finally:
            await self.close()

    async def scores(
        self, model: str, path: str, body: dict, urls: list[str], headers: dict[str, str] | None = None
    ) -> dict[str, int] | None:
        """For a request to `path` with this body: each replica's count of the prompt's leading pages it holds, for
        the replicas among urls whose picture is trusted (the others are absent); None when the request cannot be
        named exactly (kv_prompt.py) or no replica's picture is trusted. One /tokenize round trip to a replica."""
        card = self.pool.card(model)
        if card is not None and card.get("parent"):
            return None  # a LoRA adapter: its pages hash from a root each replica draws
        trusted = [url for url in urls if self.index.trusted(url)]
        if not trusted:
            return None
        replicas = self.pool.replicas
        tokenizer = min(trusted, key=lambda url: replicas[url].load().load if url in replicas else 0.0)
        tokens = await prompt_token_ids(self._client, tokenizer, model, headers or {}, path, body)
        if tokens is None:
            return None
        sizes = {self.index.block_sizes[url] for url in trusted}
        return self.index.match(trusted, page_hashes(tokens, sizes))

    async def refresh(self) -> None:
        """Follows replicas that became ready, drops those that left the pool."""
        for url in list(self._followers):
            if url not in self.pool.replicas or any(task.done() for task in self._followers[url]):
                for task in self._followers.pop(url):  # gone, or a stream failed: follow it afresh
                    task.cancel()
                self.index.forget(url)
        now = time.monotonic()
        for url, replica in list(self.pool.replicas.items()):
            if (
                replica.ready
                and url not in self._followers
                and now - self._asked.get(url, -1e9) >= ADVERT_RETRY_SECONDS
            ):
                await self._follow(url)

    async def _follow(self, url: str) -> None:
        try:
            advert: Any = (await self._client.get(f"{url}/kv_events")).json()
        except (httpx.HTTPError, ValueError) as error:
            log.debug("replica %s did not say where its KV events are: %s", url, error)
            advert = None
        endpoints = advert.get("endpoints") if isinstance(advert, dict) and advert.get("enabled") else None
        block_size = advert.get("block_size") if isinstance(advert, dict) else None
        if (
            not isinstance(endpoints, list)
            or not all(isinstance(e, str) for e in endpoints)
            or advert.get("hash") != HASH_SCHEME
            or not isinstance(block_size, int)
            or block_size < 1
        ):
            self._asked[url] = time.monotonic()
            log.info("replica %s publishes no KV events this gateway reads: it is routed by prompt hashing", url)
            return
        replays = advert.get("replay_endpoints") or [None] * len(endpoints)
        replays = [r if isinstance(r, str) else None for r in replays] if isinstance(replays, list) else []
        reachable = [reachable_endpoint(e, url) for e in endpoints]
        if any(e is None for e in reachable):
            self._asked[url] = time.monotonic()
            log.warning("replica %s publishes KV events to %s, which this gateway cannot subscribe to", url, endpoints)
            return
        streams = self.index.track(url, [e for e in reachable if e], block_size)
        topic = str(advert.get("topic", "")).encode()
        self._followers[url] = [
            asyncio.create_task(
                self._stream(stream, topic, reachable_endpoint(replay, url) if replay else None),
                name=f"kv-events {stream.endpoint}",
            )
            for stream, replay in zip(streams, replays + [None] * len(streams), strict=False)
        ]
        log.info("following the KV events of replica %s at %s", url, ", ".join(s.endpoint for s in streams))

    async def _stream(self, stream: EventStream, topic: bytes, replay: str | None) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(stream.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        resync = self.index.resync_seconds
        try:
            while True:
                for socket, _ in await poller.poll():
                    if socket is monitor:
                        event = parse_monitor_message(await monitor.recv_multipart())
                        if event["event"] == zmq.EVENT_DISCONNECTED:
                            log.info("KV events of %s: disconnected", stream.endpoint)
                            stream.lose(time.monotonic(), resync)
                        elif event["event"] == zmq.EVENT_CONNECTED and stream.expected is None and replay:
                            await asyncio.sleep(0.05)  # the subscription reaches the publisher first
                            batches = await self._replay(replay, 0)
                            if batches is not None and stream.replayed(batches, time.monotonic()):
                                log.info("KV events of %s: in step from its replay", stream.endpoint)
                        continue
                    frames = await sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        continue
                    try:
                        batch = decode_batch(frames[2])
                    except msgspec.DecodeError:
                        log.warning("KV events of %s: a batch that does not decode; dropped", stream.endpoint)
                        stream.lose(time.monotonic(), resync)
                        continue
                    await self._take(stream, int.from_bytes(frames[1], "big"), batch, replay)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - this stream only: its replica routes by hashing until it is followed again
            log.exception("KV events of %s: following them failed", stream.endpoint)
            stream.lose(time.monotonic(), resync)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _take(self, stream: EventStream, sequence: int, batch: KVEventBatch, replay: str | None) -> None:
        now = time.monotonic()
        if stream.receive(sequence, batch, now):
            return
        if replay is not None:
            batches = await self._replay(replay, stream.expected or 0)
            now = time.monotonic()
            if batches is not None and stream.replayed(batches, now) and stream.receive(sequence, batch, now):
                return
        if stream.expected is not None or stream.trusted_from != float("inf"):
            log.info("KV events of %s: batch %d lost; prompt hashing routes meanwhile", stream.endpoint, sequence)
        stream.lose(now, self.index.resync_seconds)
        stream.resume(sequence, batch)

    async def _replay(self, endpoint: str, start: int) -> list[tuple[int, KVEventBatch]] | None:
        """The batches the replica kept from `start` on (None: no answer in time)."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        batches: list[tuple[int, KVEventBatch]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + REPLAY_TIMEOUT_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                if not await dealer.poll(left * 1000):
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    continue
                sequence = int.from_bytes(frames[1], "big", signed=True)
                if sequence == END_OF_REPLAY:
                    return batches
                batches.append((sequence, decode_batch(frames[2])))
            return None
        except msgspec.DecodeError:
            return None
        finally:
            dealer.close(linger=0)

    async def close(self) -> None:
        for tasks in self._followers.values():
            for task in tasks:
                task.cancel()
        for tasks in self._followers.values():
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._followers.clear()
        await self._client.aclose()
        self.context.term()
