"""HostTier: the prefix cache's second tier: full K/V pages kept in host memory (vLLM's --kv-offloading-size).

Pages the device pool evicts are copied here under the same chained page hash (page_pool.page_hash), so a prefix
that comes back after its device pages were reused is copied to the device again instead of recomputed. The tier is
a fixed number of chunks of `chunk_pages` page slots (its bytes are bounded by construction: chunks x chunk_pages x
page bytes). A chunk holds the pages of one copy from the device as one block of bytes (host_offload.py: a JAX array
in the device's pinned host memory: one large transfer each way instead of one per page), so the chunk is the unit
of eviction: least recently used (any of its pages matched) first out, all its pages at once. Slot s is row
s % chunk_pages of chunk s // chunk_pages. A chunk whose copy is not yet committed is reserved: no lookup finds its
pages and no eviction takes it, and a copy that fails gives it back. A chunk a load reads from is pinned: eviction
passes it by until the load is done. Only the engine's thread calls it.

The key is the page hash alone: it chains every token before the page, so the same tokens give the same key on
every tier and on the gateway (which hashes prompts itself). An adapter (multi-LoRA) must join the chain as the
first page's parent, in page_pool.page_hash, so that two adapters' pages never share a key on either tier. A chunk
holds the cache's stored bytes, whatever its dtype (an FP8 cache's pages stay FP8 here). Bookkeeping only: it never
looks inside a chunk."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from .page_pool import PageHash


class HostTier:
    def __init__(self, page_bytes: int, capacity_pages: int, chunk_pages: int = 1):
        """page_bytes: one page's K/V of every layer as stored; capacity_pages >= chunk_pages >= 1."""
        assert capacity_pages >= chunk_pages >= 1, "a tier of no chunk is no tier (HostOffload refuses it)"
        self.chunk_pages = chunk_pages
        self.num_chunks = capacity_pages // chunk_pages
        self.capacity = self.num_chunks * chunk_pages
        self.page_bytes = page_bytes
        self._data: list[Any] = [None] * self.num_chunks  # chunk -> its copy (None: free or reserved)
        self._hashes: list[list[PageHash]] = [[] for _ in range(self.num_chunks)]  # chunk -> its pages, by row
        self._free: collections.deque[int] = collections.deque(range(self.num_chunks))
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # committed chunks; LRU first
        self._slot_of: dict[PageHash, int] = {}  # committed pages
        self._in_flight: set[PageHash] = set()
        self._pins: collections.Counter[int] = collections.Counter()  # chunk -> loads reading it
        self.evictions = 0  # pages evicted

    @staticmethod
    def capacity_for(size_bytes: int, page_bytes: int) -> int:
        return size_bytes // page_bytes

    @property
    def num_used(self) -> int:
        """Pages committed or reserved (the bytes in use are at most used chunks x chunk_pages x page_bytes)."""
        return sum(len(h) for h in self._hashes)

    @property
    def num_held(self) -> int:
        """Chunks holding a copy: at most num_chunks, so the bytes are bounded."""
        return sum(d is not None for d in self._data)

    def holds(self, h: PageHash) -> bool:
        """The page is here or on its way here (so it need not be copied again)."""
        return h in self._slot_of or h in self._in_flight

    def reserve(self, hashes: Sequence[PageHash]) -> list[int] | None:
        """One chunk's slots for these pages (at most chunk_pages), about to be copied here; None where every chunk
        is reserved or pinned (the pages are not kept)."""
        assert 0 < len(hashes) <= self.chunk_pages, (len(hashes), self.chunk_pages)
        if not self._free:
            self._evict_one()
        if not self._free:
            return None
        chunk = self._free.popleft()
        self._hashes[chunk] = list(hashes)
        self._in_flight.update(hashes)
        return [chunk * self.chunk_pages + row for row in range(len(hashes))]

    def _evict_one(self) -> None:
        """Frees the least recently used committed chunk that no load is reading (none: nothing is freed)."""
        for chunk in self._lru:
            if not self._pins[chunk]:
                del self._lru[chunk]
                for row, h in enumerate(self._hashes[chunk]):
                    if self._slot_of.get(h) == chunk * self.chunk_pages + row:  # (a later copy may hold it now)
                        del self._slot_of[h]
                self.evictions += len(self._hashes[chunk])
                self._release(chunk)
                return

    def _release(self, chunk: int) -> None:
        self._hashes[chunk] = []
        self._data[chunk] = None  # its bytes go with it
        self._free.append(chunk)

    def commit(self, slots: Sequence[int], data: Any) -> None:
        """The copy of reserved slots (one chunk's, from `reserve`) is data; its pages become findable."""
        chunk = slots[0] // self.chunk_pages
        self._data[chunk] = data
        for row, h in enumerate(self._hashes[chunk]):
            self._in_flight.discard(h)
            self._slot_of[h] = chunk * self.chunk_pages + row
        self._lru[chunk] = None

    def abandon(self, slots: Sequence[int]) -> None:
        """The copy failed: its chunk goes back, and its pages are recomputed when asked for."""
        chunk = slots[0] // self.chunk_pages
        self._in_flight.difference_update(self._hashes[chunk])
        self._release(chunk)

    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """The slots of the longest run of committed pages that starts hashes; their chunks become most recent."""
        slots = []
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is None:
                break
            self._lru.move_to_end(slot // self.chunk_pages)
            slots.append(slot)
        return slots

    def pin(self, slots: Sequence[int]) -> None:
        """A load will read these slots: eviction leaves their chunks alone until `unpin`."""
        self._pins.update(slot // self.chunk_pages for slot in slots)

    def unpin(self, slots: Sequence[int]) -> None:
        self._pins.subtract(slot // self.chunk_pages for slot in slots)
        for chunk in {slot // self.chunk_pages for slot in slots}:
            if self._pins[chunk] <= 0:
                del self._pins[chunk]

    @property
    def num_pinned(self) -> int:
        """Chunks some load reads."""
        return len(self._pins)

    def read(self, slots: Sequence[int]) -> list[tuple[int, Any, int]]:
        """(chunk, its copy, row) of each slot; pin them first if a reserve may run before their load is done."""
        return [
            (slot // self.chunk_pages, self._data[slot // self.chunk_pages], slot % self.chunk_pages) for slot in slots
        ]
