"""HostOffload: copies K/V pages between the device cache and the host tier (host_tier.py), never waiting on one.

Device -> host: a page the pool evicts is only named then (PagePool.on_evict); the copy is queued (`flush`) when
the engine next reads its cache to run anything on it, so the gather is ordered before any write into the page's
next owner. The gathered pages start their copy to the host at once (copy_to_host_async) and are committed to the
tier a poll after the device has produced them, by which time the copy has landed.

Host -> device: a prefix that misses on the device and hits in the tier gets fresh device pages and a staged copy
(device_put: an asynchronous host-to-device transfer into a buffer of its own). Its sequence waits while the batch
steps on; once the transfer is ready, one jitted scatter writes the pages into the cache (a device-local copy,
ordered before the next step) and the sequence is admitted with them computed. A transfer that fails or is not
written by LOAD_DEADLINE_S is dropped and its pages are recomputed: a slow copy costs time, never a wrong token.

Copies move at most MAX_PAGES_PER_COPY pages a dispatch, padded to a power of two (a handful of compiled shapes,
all compiled at warm-up). Tensor parallelism: the gathered pages keep the cache's split by KV head, so each
device copies its own heads' bytes, and a staged copy is placed with the same split."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Callable, ContextManager, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..attention import PAGES_INTERLEAVED, layout_of
from .cache import KVCache
from .host_tier import HostTier
from .page_pool import PageHash

log = logging.getLogger("capstan.kv")
MAX_PAGES_PER_COPY = 64  # pages per gather or scatter dispatch (larger copies are split)
LOAD_DEADLINE_S = 5.0
LANDED_S = 0.05  # a copy to the host started this long ago has landed once the device has produced its pages  # a host-to-device copy not ready by then is dropped: its pages are recomputed
GIB = 1 << 30


def _arrays(kv: KVCache) -> list[jax.Array]:
    return [a for a in (*kv.k, *kv.v) if a.size]  # a TPU-layout cache keeps K and V together in k


def _page_axis(kv: KVCache) -> int:
    return 0 if layout_of(kv.v[0]) == PAGES_INTERLEAVED else 1


@functools.partial(jax.jit, static_argnames=("page_axis",))
def gather_pages(kv: KVCache, pages: jax.Array, page_axis: int) -> jax.Array:
    """[len(pages), arrays, ...]: each page's K/V of every layer, as stored (dtype and layout)."""
    return jnp.stack([jnp.moveaxis(jnp.take(a, pages, axis=page_axis), page_axis, 0) for a in _arrays(kv)], axis=1)


def _scatter_pages(kv: KVCache, pages: jax.Array, data: jax.Array, page_axis: int) -> KVCache:
    """gather_pages' inverse; pages past the pool (padding) are dropped."""
    written = iter([a.at[(slice(None),) * page_axis + (pages,)].set(jnp.moveaxis(data[:, i], 0, page_axis),
                                                                     mode="drop")
                    for i, a in enumerate(_arrays(kv))])
    k = tuple(next(written) for _ in kv.k)
    v = tuple(next(written) if a.size else a for a in kv.v)
    return KVCache(k, v, kv.page_size)


# The cache is donated: the scatter updates the pages in place, as every step does.
scatter_pages = jax.jit(_scatter_pages, donate_argnums=(0,), static_argnames=("page_axis",))


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass
class _ToHost:
    data: jax.Array  # gathered pages, their copy to the host started
    slots: list[int]  # the tier's reserved slots, one per page (the data's first len(slots) rows)
    started: float
    produced: bool = False  # the device had produced data at an earlier poll: its copy has landed since


@dataclasses.dataclass
class _ToDevice:
    parts: list[tuple[np.ndarray, jax.Array]]  # (device pages padded with the pool's size, staged data)
    num_pages: int
    started: float


class HostOffload:
    def __init__(self, kv: KVCache, size_gib: float, context: Callable[[], ContextManager] = contextlib.nullcontext):
        """context: what the engine's own calls run in (precision, mesh): the copies' programs are compiled and
        called in it too, whichever caller (inside a step's context or not) reads the cache."""
        if jax.process_count() > 1:  # copies finish when they finish: hosts stepping in lockstep would diverge
            raise ValueError("kv_offloading_size: a host-memory tier is not supported on several hosts "
                             "(jax.distributed) yet; leave it at 0 there")
        self._context = context
        self.page_axis = _page_axis(kv)
        self.num_pages = kv.k[0].shape[self.page_axis]
        page = jax.eval_shape(functools.partial(gather_pages, page_axis=self.page_axis), kv,
                              jax.ShapeDtypeStruct((1,), jnp.int32))
        page_shape, page_bytes = page.shape[1:], page.size * page.dtype.itemsize
        capacity = HostTier.capacity_for(int(size_gib * GIB), page_bytes)
        if capacity < 1:
            raise ValueError(f"kv_offloading_size: {size_gib} GiB holds no K/V page ({page_bytes} bytes each); "
                             f"give at least {page_bytes / GIB:.6f} GiB")
        self.tier = HostTier(page_shape, page.dtype, capacity)
        self._staged_sharding = self._gathered_sharding(kv)  # staged copies split as gathered pages are
        self._evicted: list[tuple[int, PageHash]] = []  # named by the pool, not yet gathered
        self._to_host: list[_ToHost] = []
        self._to_device: dict[Hashable, _ToDevice] = {}
        self.bytes_to_host = self.bytes_to_device = 0
        self.pages_to_host = self.pages_to_device = 0
        self.failed_loads = 0
        self.load_seconds = 0.0  # from each load's start until its pages were written

    def _gathered_sharding(self, kv: KVCache):
        """gather_pages' output placement: the cache's split (by KV head) with the page axis first, arrays second."""
        sharding = kv.k[0].sharding
        if not isinstance(sharding, NamedSharding):  # one device: uncommitted, as the cache is (else steps recompile)
            return None
        spec = [*sharding.spec, *[None] * (kv.k[0].ndim - len(sharding.spec))]
        del spec[self.page_axis]
        return NamedSharding(sharding.mesh, P(None, None, *spec))

    @property
    def busy(self) -> bool:
        """Copies wait to be started or finished (the engine polls while this is true)."""
        return bool(self._evicted or self._to_host or self._to_device)

    # ---- device -> host ------------------------------------------------------------------------------------
    def on_evict(self, page: int, h: PageHash) -> None:
        """PagePool's hook: page, named h, is about to get a new owner; its bytes are copied before it is written."""
        self._evicted.append((page, h))

    def flush(self, kv: KVCache) -> None:
        """Queues the gathers of the pages evicted since the last flush (before anything writes the cache)."""
        evicted, self._evicted = self._evicted, []
        evicted = [(p, h) for p, h in evicted if not self.tier.holds(h)]
        for start in range(0, len(evicted), MAX_PAGES_PER_COPY):
            part = evicted[start:start + MAX_PAGES_PER_COPY]
            kept = [(p, slot) for (p, _), slot in zip(part, self.tier.reserve([h for _, h in part])) if slot is not None]
            if not kept:
                continue
            pages = np.zeros(_bucket(len(kept)), np.int32)
            pages[:len(kept)] = [p for p, _ in kept]
            with self._context():
                data = gather_pages(kv, pages, page_axis=self.page_axis)
            data.copy_to_host_async()
            self._to_host.append(_ToHost(data, [slot for _, slot in kept], time.monotonic()))

    def _finish_to_host(self) -> None:
        pending = []
        for copy in self._to_host:
            try:
                if copy.produced or time.monotonic() - copy.started > LANDED_S and copy.data.is_ready():
                    host = np.asarray(copy.data)[:len(copy.slots)]
                    self.tier.commit(copy.slots, host)
                    self.pages_to_host += len(copy.slots)
                    self.bytes_to_host += host.nbytes
                    continue
                copy.produced = copy.data.is_ready()
            except Exception:  # noqa: BLE001 - a failed copy only loses its pages from the tier
                log.exception("a K/V copy to host memory failed; its %d pages are not kept", len(copy.slots))
                self.tier.abandon(copy.slots)
                continue
            pending.append(copy)
        self._to_host = pending

    # ---- host -> device ------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """The tier's slots of the longest run of hashes it holds (marked most recently used)."""
        return self.tier.match(hashes)

    def start_load(self, key: Hashable, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Stages the slots' pages for the device pages `pages`; `poll` reports key when they are written."""
        parts = []
        for start in range(0, len(pages), MAX_PAGES_PER_COPY):
            n = min(MAX_PAGES_PER_COPY, len(pages) - start)
            padded = np.full(_bucket(n), self.num_pages, np.int32)  # past the pool: the scatter drops them
            padded[:n] = pages[start:start + n]
            data = np.zeros((len(padded), *self.tier.pages.shape[1:]), self.tier.pages.dtype)
            data[:n] = self.tier.read(slots[start:start + n])
            parts.append((padded, jax.device_put(data, self._staged_sharding)))
        self._to_device[key] = _ToDevice(parts, len(pages), time.monotonic())

    def cancel(self, key: Hashable) -> None:
        """The waiting sequence is gone (aborted): its pages are never written."""
        self._to_device.pop(key, None)

    def poll(self, kv: KVCache) -> tuple[KVCache, list[tuple[Hashable, bool]]]:
        """Finishes the copies that are ready: the cache with the loaded pages written, and (key, loaded) for each
        load that ended (False: failed or late, so its pages are to be recomputed)."""
        self._finish_to_host()
        ended = []
        for key, load in list(self._to_device.items()):
            try:  # past its deadline a load is dropped, whatever its state: no sequence waits longer
                ready = time.monotonic() - load.started <= LOAD_DEADLINE_S and \
                    all(staged.is_ready() for _, staged in load.parts)
            except Exception:  # noqa: BLE001 - the transfer failed: recompute instead
                log.exception("a K/V copy from host memory failed; its pages are recomputed")
                ready = None
            if ready:
                with self._context():
                    for pages, staged in load.parts:
                        kv = scatter_pages(kv, pages, staged, page_axis=self.page_axis)
                self.pages_to_device += load.num_pages
                self.bytes_to_device += load.num_pages * self.tier.page_bytes
                self.load_seconds += time.monotonic() - load.started
            elif ready is None or time.monotonic() - load.started > LOAD_DEADLINE_S:  # failed, or late
                self.failed_loads += 1
            else:
                continue
            del self._to_device[key]
            ended.append((key, bool(ready)))
        return kv, ended

    def warmup(self, kv: KVCache) -> KVCache:
        """Compiles every copy shape (a scatter of pages past the pool writes nothing)."""
        with self._context():
            kv = self._warmup(kv)
        jax.block_until_ready(kv)
        return kv

    def _warmup(self, kv: KVCache) -> KVCache:
        n = 1
        while n <= MAX_PAGES_PER_COPY:
            pages = np.full(n, self.num_pages, np.int32)
            gather_pages(kv, np.zeros(n, np.int32), page_axis=self.page_axis).copy_to_host_async()
            staged = jax.device_put(np.zeros((n, *self.tier.pages.shape[1:]), self.tier.pages.dtype),
                                    self._staged_sharding)
            kv = scatter_pages(kv, pages, staged, page_axis=self.page_axis)
            n *= 2
        return kv
