"""HostTier: the prefix cache's second tier: full K/V pages kept in host memory (vLLM's --kv-offloading-size).

Pages the device pool evicts are copied here under the same chained page hash (page_pool.page_hash), so a prefix
that comes back after its device pages were reused is copied to the device again instead of recomputed. The tier
is a fixed number of slots in arrays allocated once (its bytes are bounded by construction), least recently used
first out. A slot whose copy from the device is still in flight is reserved: no lookup finds it and no eviction
takes it until it is committed, and a copy that fails gives it back. A slot being read for a copy back to the device
is pinned: eviction passes it by until the read is done, so its bytes are never overwritten mid-copy. The bytes are
written and read by the copy threads (host_offload.py), the bookkeeping only by the engine's thread.

The key is the page hash alone: it chains every token before the page, so the same tokens give the same key on
every tier and on the gateway (which hashes prompts itself). An adapter (multi-LoRA) must join the chain as the
first page's parent, in page_pool.page_hash, so that two adapters' pages never share a key on either tier. A slot
holds the cache's stored bytes, whatever its dtype (an FP8 cache's pages stay FP8 here). Pure host code: no JAX."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from .page_pool import PageHash


class HostTier:
    def __init__(self, page_shape: tuple[int, ...], dtype, capacity_pages: int):
        """page_shape: one page's K/V of every layer as the device gathers it; capacity_pages >= 1."""
        assert capacity_pages >= 1, "a tier of no pages is no tier (EngineConfig refuses it)"
        self.capacity = capacity_pages
        self.pages = np.empty((capacity_pages, *page_shape), dtype)  # untouched slots cost no resident memory
        self._bytes = _raw(self.pages)  # copies go through bytes: numpy releases the GIL for those, whatever the dtype
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
    def page_bytes(self) -> int:
        return self.pages[0].nbytes

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
                self._free.append(slot)
                self.evictions += 1
                return

    def write(self, slots: Sequence[int], data: np.ndarray) -> None:
        """data[i] becomes the bytes of reserved slot slots[i] (a copy thread's half of a commit)."""
        raw = _raw(np.ascontiguousarray(data))
        for i, slot in enumerate(slots):  # row by row: contiguous copies, no index array's temporary
            self._bytes[slot] = raw[i]

    def commit(self, slots: Sequence[int], data: np.ndarray | None = None) -> None:
        """The copies have arrived (written here, or data[i] for slots[i]); the pages become findable."""
        if data is not None:
            self.write(slots, data)
        for slot in slots:
            h = self._reserved.pop(slot)
            self._in_flight.discard(h)
            self._slot_of[h] = slot

    def abandon(self, slots: Sequence[int]) -> None:
        """The copies failed: their slots go back, and their pages are recomputed when asked for."""
        for slot in slots:
            self._in_flight.discard(self._reserved.pop(slot))
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

    def read(self, slots: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """These slots' pages, copied (into out's first rows when given); pin them first if a reserve may run
        meanwhile."""
        out = np.empty((len(slots), *self.pages.shape[1:]), self.pages.dtype) if out is None else out
        np.take(
            self._bytes, np.asarray(slots, np.int64), axis=0, out=_raw(out)[: len(slots)], mode="clip"
        )  # raise: buffered
        return out


def _raw(a: np.ndarray) -> np.ndarray:
    """a's bytes, one row per page (a C-contiguous array of any dtype: bfloat16 and FP8 included)."""
    return a.reshape(a.shape[0], -1).view(np.uint8)
