"""PagePool: the host-side bookkeeping of KV pages: free list, reference counts and the prefix cache.

A full page of prompt or output tokens is named by a chained hash (its tokens plus the hash of the page
before it), so identical prefixes map to identical pages. A page whose last reference goes away keeps its
hash and waits in an LRU list: a later request with the same prefix revives it, and allocation evicts the
least recently used one only when no never-hashed page is free. With a host-memory tier (host_offload.py), each
evicted page is named to `on_evict` first, so its bytes can be copied out before its next owner writes it. With KV
events on (kv_events.py), each name evicted is recorded in `events` (and each page named, by the scheduler, which
knows its tokens) for the engine to publish."""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from .kv_events import KVEventLog

PageHash = bytes
# how page_hash names a page, for a router that names a prompt's pages itself (GET /kv_events advertises it)
HASH_SCHEME = "capstan-blake2b128-int64"


def page_hash(parent: PageHash | None, tokens: Sequence[int]) -> PageHash:
    # A cryptographic hash, so one tenant cannot craft a prompt that collides with another's cached pages.
    # With LoRA, a sequence's first page has its adapter's hash as parent (Sequence.hash_root), so no tier shares
    # pages across adapters.
    data = (parent or b"") + np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def chained_page_hashes(parent: PageHash | None, tokens: Sequence[int], page_size: int) -> list[PageHash]:
    """page_hash of each full page of tokens, each parented by the one before (the first by parent): the tokens are
    converted once for all of them (a conversion a page cost most of a 172-page prompt's ~0.6 ms)."""
    count = len(tokens) // page_size
    data = np.asarray(tokens[: count * page_size], dtype=np.int64).tobytes()
    stride = page_size * 8
    hashes: list[PageHash] = []
    for k in range(count):
        parent = hashlib.blake2b((parent or b"") + data[k * stride : (k + 1) * stride], digest_size=16).digest()
        hashes.append(parent)
    return hashes


class OutOfPagesError(Exception):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self._free: collections.deque[int] = collections.deque(range(num_pages))  # unreferenced and unhashed
        self._evictable: collections.OrderedDict[int, None] = (
            collections.OrderedDict()
        )  # unreferenced, hashed; LRU first
        self._hash_of: dict[int, PageHash] = {}
        self._page_of: dict[PageHash, int] = {}
        self.on_evict: Callable[[int, PageHash], None] | None = None  # the host tier's hook (HostOffload.on_evict)
        self.events: KVEventLog | None = None  # set when the engine publishes KV events

    @property
    def num_free(self) -> int:
        """Pages that an allocation can take now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfPagesError(f"need {count} pages, {self.num_free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                h = self._hash_of.pop(page)
                del self._page_of[h]
                if self.events is not None:
                    self.events.removed(h)
                if self.on_evict is not None:
                    self.on_evict(page, h)
            self.ref_count[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """Adds a reference to pages already held (n > 1 choices share their prompt's pages)."""
        for page in pages:
            assert self.ref_count[page] > 0, f"page {page} is not held"
            self.ref_count[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            assert self.ref_count[page] > 0, f"page {page} released twice"
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def lookup(self, page_hashes: Sequence[PageHash]) -> tuple[list[int], list[PageHash]]:
        """The longest run of cached pages that starts page_hashes (a prompt's chained hashes, as many full pages as
        may be cached: the step must compute at least one token to sample), referenced for the caller."""
        if not self.enable_prefix_caching:
            return [], []
        pages, hashes = [], []
        for h in page_hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
            hashes.append(h)
        for page in pages:  # referenced once the whole run is found
            if self.ref_count[page] == 0:
                del self._evictable[page]
            self.ref_count[page] += 1
        return pages, hashes

    def holds(self, h: PageHash) -> bool:
        """A page named h is cached (a lookup would find it; nothing is referenced)."""
        return h in self._page_of

    def register(self, page: int, h: PageHash) -> bool:
        """Names a page that now holds a full page of computed tokens, so later prefixes can find it; False when it
        was not named (a page or a hash already named, or no prefix caching)."""
        if not self.enable_prefix_caching or h in self._page_of or page in self._hash_of:
            return False
        self._hash_of[page] = h
        self._page_of[h] = page
        return True

    def check_all_free(self) -> None:
        """For tests and drain: every page is unreferenced."""
        held = [p for p, c in enumerate(self.ref_count) if c]
        assert not held, f"pages still held: {held[:10]}"
