"""KVEventIndex: which replica holds which KV pages, from the replicas' own KV events (runtime/kv/kv_events.py), and
each replica's score for a prompt: how many of its leading full pages that replica has cached. Pure: the
subscriber (kv_subscriber.py) feeds it batches; routing reads `match`.

A replica's picture is trusted only while its stream is whole. Each stream (one per engine core) numbers its
batches; the index applies them in order and reports a gap (a lost batch, a subscriber that joined late) to the
subscriber, which asks the replica to replay what it kept. When that cannot fill the gap, the stream `loses` its
picture: what the index knew is dropped (it may name pages evicted since), what comes after is applied (so the
picture is a subset of the truth: it can under-score, never over-score) and the replica is left out of scoring
for `resync_seconds`, so its requests route by prompt hashing meanwhile. A stream that disconnects loses likewise."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

DEFAULT_RESYNC_SECONDS = 5.0  # after a lost batch: hashing routes that replica until its picture has refilled


@dataclass
class EventStream:
    """One engine core's events: the pages it holds, and where its sequence stands."""

    endpoint: str
    blocks: set[bytes] = field(default_factory=set)
    expected: int | None = None  # the next batch's sequence number; None: not in step (new, or lost)
    trusted_from: float = float("inf")  # monotonic time from which its picture counts
    applied: int = 0
    gaps: int = 0

    def trusted(self, now: float) -> bool:
        return self.expected is not None and now >= self.trusted_from

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
        self.applied += 1

    def receive(self, sequence: int, batch: KVEventBatch, now: float) -> bool:
        """Applies a live batch if it is the next one (True); False: a gap, for the caller to fill (replay) or
        `lose`. A batch numbered 0 after others is a restarted replica: it starts over (its cache is empty)."""
        if sequence == 0 and (self.expected is None or self.expected > 0):
            self.blocks.clear()
            self.expected, self.trusted_from = 0, min(self.trusted_from, now)
        if self.expected is not None and sequence < self.expected:
            return True  # already applied (a replay overlapped the live stream)
        if sequence != self.expected:
            return False
        self.apply(batch)
        self.expected = sequence + 1
        return True

    def replayed(self, batches: list[tuple[int, KVEventBatch]], now: float) -> bool:
        """Fills a gap from the replica's replay (ascending): True when it covered it, from where this stream stood
        (or from batch 0, for a stream never in step)."""
        start = self.expected if self.expected is not None else 0
        wanted = start
        for sequence, batch in batches:
            if sequence < wanted:
                continue
            if sequence != wanted:
                return False
            if self.expected is None and sequence == 0:
                self.blocks.clear()
            self.apply(batch)
            wanted = sequence + 1
        if wanted == start and self.expected is None:
            return False  # nothing kept from batch 0: the beginning is lost
        if self.expected is None:
            self.trusted_from = now
        self.expected = wanted
        return True

    def lose(self, now: float, resync_seconds: float) -> None:
        """A gap nobody can fill, or the stream dropped: forget the picture, distrust it for a while."""
        self.blocks.clear()
        self.expected = None
        self.gaps += 1
        self.trusted_from = now + resync_seconds

    def resume(self, sequence: int, batch: KVEventBatch) -> None:
        """After `lose`: apply what comes next (a subset of the truth from here on)."""
        self.apply(batch)
        self.expected = sequence + 1

    def matched(self, hashes: list[bytes]) -> int:
        count = 0
        for h in hashes:
            if h not in self.blocks:
                break
            count += 1
        return count


class KVEventIndex:
    """Every replica's event streams by replica URL, and their scores for a prompt's page hashes."""

    def __init__(self, resync_seconds: float = DEFAULT_RESYNC_SECONDS):
        self.resync_seconds = resync_seconds
        self.streams: dict[str, list[EventStream]] = {}
        self.block_sizes: dict[str, int] = {}

    def track(self, url: str, endpoints: list[str], block_size: int) -> list[EventStream]:
        self.streams[url] = [EventStream(endpoint) for endpoint in endpoints]
        self.block_sizes[url] = block_size
        return self.streams[url]

    def forget(self, url: str) -> None:
        self.streams.pop(url, None)
        self.block_sizes.pop(url, None)

    def trusted(self, url: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        streams = self.streams.get(url) or []
        return bool(streams) and all(s.trusted(now) for s in streams)

    def match(self, urls: list[str], hashes_by_size: dict[int, list[bytes]]) -> dict[str, int]:
        """Each trusted replica's count of leading pages cached (the least over its engine cores: a replica sends a
        request to any of them); replicas whose picture is not trusted are left out."""
        now = time.monotonic()
        scores = {}
        for url in urls:
            if not self.trusted(url, now):
                continue
            hashes = hashes_by_size.get(self.block_sizes[url])
            if hashes is None:
                continue
            scores[url] = min(s.matched(hashes) for s in self.streams[url])
        return scores
