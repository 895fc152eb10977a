"""HostOffload: copies K/V pages between the device cache and the host tier (host_tier.py), never waiting on one.

Device -> host: a page the pool evicts is only named then (PagePool.on_evict); the copy is queued (`flush`) when
the engine next reads its cache to run anything on it, so the gather is ordered before any write into the page's
next owner. The gathered pages start their copy to the host at once (copy_to_host_async); a copy thread waits for
them and writes their bytes into the tier, and the engine's next poll makes them findable.

Host -> device: a prefix that misses on the device and hits in the tier gets fresh device pages and a load: the
tier's slots are pinned (no eviction reuses them meanwhile) and a second copy thread stages their bytes and
transfers them (device_put, waited for there), so the engine's thread does no byte work and never waits. Its
sequence waits while the batch steps on; the first poll after the transfer has landed writes the pages into the
cache with one jitted scatter (a device-local copy, ordered before the next step) and admits the sequence with them
computed. Staging buffers are reused, except one its transfer aliased (on CPU devices: it is then the staged copy
until the scatter has read it). A load that fails or has not landed by LOAD_DEADLINE_S is dropped and its pages
are recomputed: a slow copy costs time, never a wrong token.

Copies move at most MAX_PAGES_PER_COPY pages a dispatch, padded to a power of two (a handful of compiled shapes,
all compiled at warm-up). Tensor parallelism: the gathered pages keep the cache's split by KV head, so each
device copies its own heads' bytes, and a staged copy is placed with the same split. `timings` splits a load's
time into its phases (the benchmark prints them)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

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
LOAD_DEADLINE_S = 5.0  # a host-to-device copy not landed by then is dropped: its pages are recomputed
STAGING_BUFFERS = 4  # kept per copy shape for loads (host memory: 4 x 64 pages at most for the largest)
MAX_COPIES_TO_HOST = 32  # gathers waiting for the copy thread (device memory): past this, evicted pages are not kept
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
    written = iter(
        [
            a.at[(slice(None),) * page_axis + (pages,)].set(jnp.moveaxis(data[:, i], 0, page_axis), mode="drop")
            for i, a in enumerate(_arrays(kv))
        ]
    )
    k = tuple(next(written) for _ in kv.k)
    v = tuple(next(written) if a.size else a for a in kv.v)
    return KVCache(k, v, kv.page_size)


# The cache is donated: the scatter updates the pages in place, as every step does.
scatter_pages = jax.jit(_scatter_pages, donate_argnums=(0,), static_argnames=("page_axis",))


def _aliases(staged: jax.Array, data: np.ndarray) -> bool:
    """Whether a shard of staged is data's own memory: the CPU client copies no 64-byte-aligned numpy array, whatever
    may_alias says (device_put ignores it for numpy arrays, jax 0.10); a transfer to an accelerator always copies."""
    lo, hi = data.ctypes.data, data.ctypes.data + data.nbytes
    return any(
        s.device.platform == "cpu" and lo <= s.data.unsafe_buffer_pointer() < hi for s in staged.addressable_shards
    )


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass
class _ToHost:
    future: Future  # the copy thread's wait for the gathered pages and their write into the tier
    slots: list[int]  # the tier's reserved slots, one per page


@dataclasses.dataclass
class _ToDevice:
    parts: list[np.ndarray]  # device pages of each staged part, padded with the pool's size (the scatter drops those)
    slots: list[int]  # pinned in the tier until the copy thread has read them
    future: Future  # the copy thread's staged parts, landed on the device, and when they landed
    started: float


# What a load is known by: the scheduler's Sequence (this room names no type of the rooms above it)
LoadKey = TypeVar("LoadKey", bound=Hashable)


class HostOffload(Generic[LoadKey]):
    def __init__(
        self, kv: KVCache, size_gib: float, context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    ):
        """context: what the engine's own calls run in (precision, mesh): the copies' programs are compiled and
        called in it too, whichever caller (inside a step's context or not) reads the cache."""
        if jax.process_count() > 1:  # copies finish when they finish: hosts stepping in lockstep would diverge
            raise ValueError(
                "kv_offloading_size: a host-memory tier is not supported on several hosts "
                "(jax.distributed) yet; leave it at 0 there"
            )
        self._context = context
        self.page_axis = _page_axis(kv)
        self.num_pages = kv.k[0].shape[self.page_axis]
        page = jax.eval_shape(
            functools.partial(gather_pages, page_axis=self.page_axis), kv, jax.ShapeDtypeStruct((1,), jnp.int32)
        )
        page_shape, page_bytes = page.shape[1:], page.size * page.dtype.itemsize
        capacity = HostTier.capacity_for(int(size_gib * GIB), page_bytes)
        if capacity < 1:
            raise ValueError(
                f"kv_offloading_size: {size_gib} GiB holds no K/V page ({page_bytes} bytes each); "
                f"give at least {page_bytes / GIB:.6f} GiB"
            )
        self.tier = HostTier(page_shape, page.dtype, capacity)
        self._staged_sharding = self._gathered_sharding(kv)  # staged copies split as gathered pages are
        self._evicted: list[tuple[int, PageHash]] = []  # named by the pool, not yet gathered
        self._to_host: list[_ToHost] = []
        self._to_device: dict[LoadKey, _ToDevice] = {}
        self._draining: list[_ToDevice] = []  # dropped loads whose copy thread still reads their pinned slots
        self._staging: dict[int, list[np.ndarray]] = collections.defaultdict(list)  # (copy thread's) reused buffers
        # one thread each way: a load never queues behind evicted pages' writes
        self._host_writer = ThreadPoolExecutor(1, thread_name_prefix="capstan-kv-to-host")
        self._device_loader = ThreadPoolExecutor(1, thread_name_prefix="capstan-kv-to-device")
        self.bytes_to_host = self.bytes_to_device = 0
        self.pages_to_host = self.pages_to_device = 0
        self.failed_loads = self.skipped_to_host = 0
        self.load_seconds = 0.0  # from each load's start until its pages were written
        self.timings: collections.defaultdict[str, float] = collections.defaultdict(float)  # seconds by phase
        self.load_phases: collections.deque = collections.deque(maxlen=4096)  # (landed, written) s after start

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
        """Copies wait to be finished (the engine polls while this is true); evicted pages not gathered yet are not
        counted: the next read of the cache, which comes before any write, queues them."""
        return bool(self._to_host or self._to_device or self._draining)

    @property
    def landed(self) -> bool:
        """Some load's pages are on the device, waiting for a poll to write them (a decode run ends for it)."""
        return any(load.future.done() for load in self._to_device.values())

    def wait_landed(self, timeout_s: float) -> None:
        """Blocks (the GIL released, so the copy threads run) until a load lands or timeout_s passes."""
        futures.wait([load.future for load in self._to_device.values()], timeout_s, futures.FIRST_COMPLETED)

    # ---- device -> host ------------------------------------------------------------------------------------
    def on_evict(self, page: int, h: PageHash) -> None:
        """PagePool's hook: page, named h, is about to get a new owner; its bytes are copied before it is written."""
        self._evicted.append((page, h))

    def flush(self, kv: KVCache) -> None:
        """Queues the gathers of the pages evicted since the last flush (before anything writes the cache)."""
        if not self._evicted:
            return
        t = time.perf_counter()
        evicted, self._evicted = self._evicted, []
        evicted = [(p, h) for p, h in evicted if not self.tier.holds(h)]
        for start in range(0, len(evicted), MAX_PAGES_PER_COPY):
            part = evicted[start : start + MAX_PAGES_PER_COPY]
            if len(self._to_host) >= MAX_COPIES_TO_HOST:  # the copy thread is behind: these pages are recomputed
                self.skipped_to_host += len(part)
                continue
            kept = [
                (p, slot)
                for (p, _), slot in zip(part, self.tier.reserve([h for _, h in part]), strict=True)
                if slot is not None
            ]
            if not kept:
                continue
            pages = np.zeros(_bucket(len(kept)), np.int32)
            pages[: len(kept)] = [p for p, _ in kept]
            with self._context():
                data = gather_pages(kv, pages, page_axis=self.page_axis)
            data.copy_to_host_async()
            slots = [slot for _, slot in kept]
            self._to_host.append(_ToHost(self._host_writer.submit(self._write_to_tier, data, slots), slots))
        self.timings["step_thread_flush"] += time.perf_counter() - t

    def _write_to_tier(self, data: jax.Array, slots: list[int]) -> int:
        """(copy thread) Waits for the gathered pages on the host and writes them into their reserved slots."""
        t = time.perf_counter()
        host = np.asarray(data)
        self.tier.write(slots, host)
        self.timings["copy_thread_to_host"] += time.perf_counter() - t
        return len(slots) * self.tier.page_bytes

    def _finish_to_host(self) -> None:
        pending = []
        for copy in self._to_host:
            if not copy.future.done():
                pending.append(copy)
                continue
            try:
                nbytes = copy.future.result()
            except Exception:  # noqa: BLE001 - a failed copy only loses its pages from the tier
                log.exception("a K/V copy to host memory failed; its %d pages are not kept", len(copy.slots))
                self.tier.abandon(copy.slots)
                continue
            self.tier.commit(copy.slots)
            self.pages_to_host += len(copy.slots)
            self.bytes_to_host += nbytes
        self._to_host = pending

    # ---- host -> device ------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """The tier's slots of the longest run of hashes it holds (marked most recently used)."""
        return self.tier.match(hashes)

    def start_load(self, key: LoadKey, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Starts copying the slots' pages to the device pages `pages`; `poll` reports key when they are written."""
        parts, slots = [], list(slots)
        for start in range(0, len(pages), MAX_PAGES_PER_COPY):
            n = min(MAX_PAGES_PER_COPY, len(pages) - start)
            padded = np.full(_bucket(n), self.num_pages, np.int32)  # past the pool: the scatter drops them
            padded[:n] = pages[start : start + n]
            parts.append(padded)
        self.tier.pin(slots)
        future = self._device_loader.submit(self._stage, slots, [len(p) for p in parts])
        self._to_device[key] = _ToDevice(parts, slots, future, time.monotonic())

    def _stage(self, slots: list[int], buckets: list[int]) -> tuple[list[jax.Array], float]:
        """(copy thread) The slots' pages on the device, one array per part, and when they had landed there."""
        staged, buffers, at = [], [], 0
        for bucket in buckets:
            t = time.perf_counter()
            part = slots[at : at + MAX_PAGES_PER_COPY]
            at += len(part)
            free = self._staging[bucket]  # reused: a fresh buffer's first touch costs more than the copy into it
            data = free.pop() if free else np.empty((bucket, *self.tier.pages.shape[1:]), self.tier.pages.dtype)
            self.tier.read(part, out=data)  # rows past the part are padding, dropped by the scatter: left as they are
            buffers.append(data)
            t2 = time.perf_counter()
            staged.append(jax.device_put(data, self._staged_sharding, may_alias=False))
            self.timings["copy_thread_stage"] += t2 - t
            self.timings["copy_thread_device_put"] += time.perf_counter() - t2
        t = time.perf_counter()
        jax.block_until_ready(staged)
        self.timings["copy_thread_transfer_wait"] += time.perf_counter() - t
        for data, part in zip(buffers, staged, strict=True):  # the transfers are done with them
            # a buffer the staged copy aliases is that copy until the scatter has read it: reused, the next load
            # would rewrite this one's pages (issue 33's divergence)
            if not _aliases(part, data) and len(self._staging[len(data)]) < STAGING_BUFFERS:
                self._staging[len(data)].append(data)
        return staged, time.monotonic()

    def cancel(self, key: LoadKey) -> None:
        """The waiting sequence is gone (aborted): its pages are never written."""
        load = self._to_device.pop(key, None)
        if load is not None:
            self._draining.append(load)

    def _drain(self) -> None:
        """Unpins the slots of dropped loads once the copy thread is done reading them."""
        for load in [d for d in self._draining if d.future.done()]:
            self.tier.unpin(load.slots)
            self._draining.remove(load)

    def poll(self, read_kv: Callable[[], KVCache]) -> tuple[KVCache | None, list[tuple[LoadKey, bool]]]:
        """Finishes the copies that are ready: the cache with the loaded pages written (None when no load landed:
        the cache was not read, so a queued decode dispatch was not waited for), and (key, loaded) for each load that
        ended (False: failed or late, so its pages are to be recomputed)."""
        t = time.perf_counter()
        self._finish_to_host()
        self._drain()
        kv: KVCache | None = None
        ended: list[tuple[LoadKey, bool]] = []
        for key, load in list(self._to_device.items()):
            late = time.monotonic() - load.started > LOAD_DEADLINE_S  # dropped, whatever its state
            if not late and not load.future.done():
                continue
            del self._to_device[key]
            if late:
                self._draining.append(load)
                self.failed_loads += 1
                ended.append((key, False))
                continue
            self.tier.unpin(load.slots)
            try:
                staged, landed = load.future.result()
            except Exception:  # noqa: BLE001 - the transfer failed: recompute instead
                log.exception("a K/V copy from host memory failed; its pages are recomputed")
                self.failed_loads += 1
                ended.append((key, False))
                continue
            kv = read_kv() if kv is None else kv
            with self._context():
                for pages, part in zip(load.parts, staged, strict=True):
                    kv = scatter_pages(kv, pages, part, page_axis=self.page_axis)
            now = time.monotonic()
            self.pages_to_device += len(load.slots)
            self.bytes_to_device += len(load.slots) * self.tier.page_bytes
            self.load_seconds += now - load.started
            self.load_phases.append((landed - load.started, now - landed))
            ended.append((key, True))
        self.timings["step_thread_poll"] += time.perf_counter() - t
        return kv, ended

    def timing_summary(self) -> dict:
        """Seconds by phase (the copy threads' and the engine thread's), and loads' p50/p99 from start until their
        pages had landed on the device and until the engine had written them into the cache."""
        out = {k: round(v, 4) for k, v in sorted(self.timings.items())}
        if self.load_phases:
            landed, written = np.asarray(self.load_phases).T
            for name, xs in (("landed", landed), ("noticed", written)):
                out[f"load_{name}_p50_ms"] = round(float(np.percentile(xs, 50)) * 1000, 2)
                out[f"load_{name}_p99_ms"] = round(float(np.percentile(xs, 99)) * 1000, 2)
        out["skipped_to_host_pages"] = self.skipped_to_host
        return out

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
            staged = jax.device_put(
                np.zeros((n, *self.tier.pages.shape[1:]), self.tier.pages.dtype), self._staged_sharding
            )
            kv = scatter_pages(kv, pages, staged, page_axis=self.page_axis)
            n *= 2
        return kv
