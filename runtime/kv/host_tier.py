"""HostTier: the prefix cache's second tier: full K/V pages kept in host memory (vLLM's --kv-offloading-size).

Pages the device pool evicts are copied here under the same chained page hash (page_pool.page_hash), so a prefix
that comes back after its device pages were reused is copied to the device again instead of recomputed. The tier
is a fixed number of slots, each holding at most one page (its bytes are bounded by construction: slots x page
bytes), least recently used first out. A slot holds its page as whatever the copier gave it (host_offload.py: a JAX
array in the device's pinned host memory, copied there by the device); a freed slot drops it. A slot whose copy from
the device is not yet committed is reserved: no lookup finds it and no eviction takes it until it is committed, and
a copy that fails gives it back. A slot being read for a copy back to the device is pinned: eviction passes it by
until the load is done. Only the engine's thread calls it.

The key is the page hash alone: it chains every token before the page, so the same tokens give the same key on
every tier and on the gateway (which hashes prompts itself). An adapter (multi-LoRA) must join the chain as the
first page's parent, in page_pool.page_hash, so that two adapters' pages never share a key on either tier. A slot
holds the cache's stored bytes, whatever its dtype (an FP8 cache's pages stay FP8 here). Bookkeeping only: it never
looks inside a page."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from .page_pool import PageHash


class HostTier:
    def __init__(self, page_bytes: int, capacity_pages: int):
        """page_bytes: one page's K/V of every layer as stored; capacity_pages >= 1."""
        assert capacity_pages >= 1, "a tier of no pages is no tier (EngineConfig refuses it)"
        self.capacity = capacity_pages
        self.page_bytes = page_bytes
        self._pages: list[Any] = [None] * capacity_pages  # slot -> its page (None: free)
        self._free: collections.deque[int] = collections.deque(range(capacity_pages))
        self._slot_of: collections.OrderedDict[PageHash, int] = collections.OrderedDict()  # committed; LRU first
        self._reserved: dict[int, PageHash] = {}  # slot -> hash of a copy in flight
        self._in_flight: set[PageHash] = set()
        self._pins: collections.Counter[int] = collections.Counter()  # slot -> copies to the device reading it
        self.evictions = 0

    @staticmethod
    def capacity_for(size_bytes: int, page_bytes: int) -> int:
        return size_bytes // page_bytes

    @property
    def num_held(self) -> int:
        """Slots holding a page (committed, or written and about to be): at most capacity, so bytes are bounded."""
        return sum(p is not None for p in self._pages)

    @property
    def num_used(self) -> int:
        """Slots committed or reserved (the tier's bytes in use are this times page_bytes)."""
        return self.capacity - len(self._free)

    def holds(self, h: PageHash) -> bool:
        """The page is here or on its way here (so it need not be copied again)."""
        return h in self._slot_of or h in self._in_flight

    def reserve(self, hashes: Sequence[PageHash]) -> list[int | None]:
        """A slot for each page about to be copied here; None where every slot is reserved (that page is not kept)."""
        slots = []
        for h in hashes:
            if not self._free:
                self._evict_one()
            slot = self._free.popleft() if self._free else None
            if slot is not None:
                self._reserved[slot] = h
                self._in_flight.add(h)
            slots.append(slot)
        return slots

    def _evict_one(self) -> None:
        """Frees the least recently used committed slot that no copy is reading (none: nothing is freed)."""
        for h, slot in self._slot_of.items():
            if not self._pins[slot]:
                del self._slot_of[h]
                self._pages[slot] = None  # its bytes go with it
                self._free.append(slot)
                self.evictions += 1
                return

    def commit(self, slots: Sequence[int], pages: Sequence[Any]) -> None:
        """pages[i] is reserved slot slots[i]'s page; the pages become findable."""
        for slot, page in zip(slots, pages, strict=True):
            self._pages[slot] = page
        for slot in slots:
            h = self._reserved.pop(slot)
            self._in_flight.discard(h)
            self._slot_of[h] = slot

    def abandon(self, slots: Sequence[int]) -> None:
        """The copies failed: their slots go back, and their pages are recomputed when asked for."""
        for slot in slots:
            self._in_flight.discard(self._reserved.pop(slot))
            self._pages[slot] = None
            self._free.append(slot)

    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """The slots of the longest run of committed pages that starts hashes; each one becomes most recent."""
        slots = []
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is None:
                break
            self._slot_of.move_to_end(h)
            slots.append(slot)
        return slots

    def pin(self, slots: Sequence[int]) -> None:
        """A copy to the device will read these slots: eviction leaves them alone until `unpin`."""
        self._pins.update(slots)

    def unpin(self, slots: Sequence[int]) -> None:
        self._pins.subtract(slots)
        for slot in slots:
            if self._pins[slot] <= 0:
                del self._pins[slot]

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def read(self, slots: Sequence[int]) -> list[Any]:
        """These slots' pages; pin them first if a reserve may run before their load is done."""
        return [self._pages[slot] for slot in slots]
