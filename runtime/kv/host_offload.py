"""HostOffload: copies K/V pages between the device cache and the host tier (host_tier.py), never waiting on one.

The tier's pages live in the device's pinned host memory as JAX arrays (memory kind "pinned_host"), one per copy of
up to CHUNK_PAGES pages (the tier's chunks), so both ways are large DMA transfers the runtime runs asynchronously, at
the link's speed (H100: 44-51 GB/s against 5-9 for a numpy device_put and 3.5-4.8 for gathering numpy slots,
benchmarks/host_transfer.py; one array per page cost ~0.5 ms of host time a page), and no thread of ours touches
the bytes.

Device -> host: a page the pool evicts is only named then (PagePool.on_evict); its copy is queued (`flush`) when the
engine next reads its cache to run anything on it, so the gather is ordered before any write into the page's next
owner: one jitted gather takes a power of two of chunks of evicted pages (a chunk's pages to each output array), and
`device_put` to pinned host memory, on a thread of its own, copies them out (once because that call waited on the
host for the gather; on jax 0.11.2 it returns at once, but made on the engine thread the poll's scatters that follow
it took longer: H200, 1B shape, returning turns' TTFT p50 64.9-69.4 ms against 53.9-62.0 with the thread,
benchmarks/RESULTS.md, twenty-fourth session). A chunk stays reserved (no lookup finds it) until the engine commits
the finished copy on its next poll or lookup.

Host -> device: a prefix that misses on the device and hits in the tier gets fresh device pages and a load: the
tier's chunks are pinned (no eviction drops them meanwhile) and its sequence waits while the batch steps on. The next
poll writes its pages into the cache with jitted scatters (each a power of two of chunks, every load the poll
finishes together) and admits the sequence with them computed. LOAD_WAY "eager": the load's start `device_put`s
each chunk it reads to the device, and the poll's scatter takes those arrays, landed or not (the device orders it
after their copies; the host never waits). A copy to the device starts only once the programs queued before it have
run (H200, benchmarks/copy_overlap.py: 1 GiB started after a 86 ms program is ready at 106 ms, started before it at
23 ms, beside it): it runs beside the programs queued after it, never beside the step under way when it starts.
"same-step" (the default): `device_put` as eager, and the scatter follows in the same engine step, before its dispatch, so the
sequence is admitted in the schedule that started its load (the step's program waits on the device for the copy
instead of the sequence waiting a step on the host; H100, 1B shape: returning turns' TTFT p50 84.4 ms against
eager's 97.8). "arrival": same-step, and a sequence's copies start when it arrives (`prefetch`, within
PREFETCH_MAX_BYTES of device memory), ahead of the schedule (they still wait for the dispatch under way); its
load at admission takes them.
"direct":
the scatter reads the chunks from host memory itself (the copy is part of a program ordered before the next step, so
the step waits for it: H200, 8B shape, returning turns' TTFT p50 179 ms against eager's 140). "staged": `device_put`
as eager, and the first poll after all are `is_ready` scatters them. "same-step-direct": same-step's admission with
direct's scatter, before the step of the schedule that starts the load (a program copies what device_put would, and
after the same queued dispatch; the engine thread makes no device_put a chunk: H200, 1B FP8 pages, returning turns
14-20% sooner; the 8B in bf16 16% later, its GB-sized waves copied by the program slower). A load that fails or has
not been written by LOAD_DEADLINE_S is dropped and its pages are recomputed: a slow copy costs time, never a wrong
token.

CAPSTAN_KV_OFFLOAD_SIDE_STREAM=1 (off by default; not with the direct ways): a load's chunks are copied into
staging buffers taken when the tier is made, on a CUDA stream of our own (side_copy.py), so they start at once
instead of after the queued dispatch; the engine waits on the host for them before the scatter that reads them,
and a buffer is reused only once that scatter has run. H200: the 1B shape's returning turns 12-20% sooner; the 8B's
16% later (its waves' copies, ~2.9 GB, then hold the engine thread while the device idles). docs/runtime.md has the
figures.

Pinned host memory: the runtime pins it as its pool grows (cudaHostAlloc, seconds for a few GiB, stalling the steps:
H100, returning turns' p99 1.9-3.6 s), so warm-up takes the tier's whole size once and gives it back to the pool.

Every gather and scatter has the chunk's shape (one compiled shape each way, compiled at warm-up). Tensor
parallelism: the pages keep the cache's split by KV head, on the host too, so each device copies its own heads'
bytes. On a CPU device the host memory is the device's: the same code runs there.
`timings` splits the engine thread's time by phase (the benchmark prints them)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ..attention import PAGES_INTERLEAVED, layout_of
from . import side_copy
from .cache import KVCache
from .host_tier import HostTier
from .page_pool import PageHash

log = logging.getLogger("capstan.kv")
CHUNK_PAGES = 16  # pages a copy to the host moves at most (8B: 32 MiB); a small tier's chunks are 1/16 of it
LOAD_DEADLINE_S = 5.0  # a host-to-device copy not landed by then is dropped: its pages are recomputed
HOST_MEMORY = "pinned_host"  # where the tier's pages live: the DMA engines read and write it directly
GIB = 1 << 30
# How a load reaches the device (CAPSTAN_KV_OFFLOAD_LOAD_WAY): "eager": device_put starts a copy of each chunk, and
# the next poll scatters them whether or not they have landed (the device orders the scatter after the copies);
# "same-step": device_put as eager, the scatter before the very step that admits the sequence; "direct": the scatter,
# dispatched on the next poll, reads the chunks from host memory itself; "staged": device_put first, the scatter once
# every copy is_ready.
# "same-step-direct": same-step's admission, with direct's scatter (no device_put a chunk: less host work a load).
LOAD_WAY = os.environ.get("CAPSTAN_KV_OFFLOAD_LOAD_WAY", "same-step")
LOAD_WAYS = ("direct", "staged", "eager", "same-step", "arrival", "same-step-direct")
# device memory that copies started at arrival ("arrival") hold at most, together: CAPSTAN_KV_OFFLOAD_PREFETCH_MIB
PREFETCH_SETTING = "CAPSTAN_KV_OFFLOAD_PREFETCH_MIB"
PREFETCH_MIB = 512
# Warm-up takes the tier's pinned host memory before serving (CAPSTAN_KV_OFFLOAD_PREALLOCATE=1, the default; GPUs)
PREALLOCATE = os.environ.get("CAPSTAN_KV_OFFLOAD_PREALLOCATE", "1") == "1"
# Copies to the device on a CUDA stream of our own into staging buffers taken when the tier is made (side_copy.py),
# so they run beside the programs queued before them: CAPSTAN_KV_OFFLOAD_SIDE_STREAM=1 (read when a tier is made;
# NVIDIA GPUs, and CPUs by memmove; elsewhere device_put), with CAPSTAN_KV_OFFLOAD_STAGING_MIB of device memory
SIDE_STREAM_SETTING = "CAPSTAN_KV_OFFLOAD_SIDE_STREAM"
STAGING_SETTING = "CAPSTAN_KV_OFFLOAD_STAGING_MIB"
STAGING_MIB = 1024


def _pages_setting(name: str, value: str | None, default: int, least: int, most: int) -> int:
    """An environment variable's page count: default when unset or empty, else a whole number in [least, most]."""
    if value is None or value == "":
        return default
    if not (value.isascii() and value.isdigit()) or not least <= int(value) <= most:
        raise ValueError(f"{name}: {value!r} is not a whole number of pages from {least} to {most}")
    return int(value)


def restore_headroom_setting(value: str | None) -> int:
    """CAPSTAN_KV_OFFLOAD_RESTORE_HEADROOM: free pages a load leaves per running sequence (0, the default: it takes
    every free page it needs). A restored sequence takes all its pages at once, so under pressure the running ones
    are preempted for their next pages (H100, 1B shape, a pool of half the batch: 227 preemptions against 109
    without the tier, 0.84x the prefix cache alone; `bash benchmarks/gpu_suite.sh tierpreempt`)."""
    return _pages_setting("CAPSTAN_KV_OFFLOAD_RESTORE_HEADROOM", value, 0, 0, 1024)


def _mib_setting(name: str, value: str | None, default: float) -> float:
    """An environment variable's size in MiB: default when unset, else a number in (0, 1048576]."""
    if value is None:
        return default
    try:
        mib = float(value)
    except ValueError:
        mib = -1.0
    if not 0 < mib <= 1 << 20:  # (NaN fails this too)
        raise ValueError(f"{name}: {value!r} is not a size in MiB in (0, 1048576]")
    return mib


def staging_mib_setting(value: str | None) -> float:
    """CAPSTAN_KV_OFFLOAD_STAGING_MIB: the side stream's staging buffers' device memory (at least one chunk's)."""
    return _mib_setting(STAGING_SETTING, value, STAGING_MIB)


def prefetch_mib_setting(value: str | None) -> float:
    """CAPSTAN_KV_OFFLOAD_PREFETCH_MIB: device memory that copies started at arrival ("arrival") hold at most,
    together (512 by default: ~1.4 returning 8B turns of the multi-turn benchmark, ~16 of the 1B's)."""
    return _mib_setting(PREFETCH_SETTING, value, PREFETCH_MIB)


def chunk_pages_setting(value: str | None) -> int:
    """CAPSTAN_KV_OFFLOAD_CHUNK_PAGES: pages a chunk holds at most (CHUNK_PAGES by default: 8 MiB on the 1B shape, 32
    MiB on the 8B; fewer, larger chunks mean fewer device_puts a load, each a host call of ~0.1 ms, and coarser
    eviction)."""
    return _pages_setting("CAPSTAN_KV_OFFLOAD_CHUNK_PAGES", value, CHUNK_PAGES, 1, 4096)


def _arrays(kv: KVCache) -> list[jax.Array]:
    return [a for a in (*kv.k, *kv.v) if a.size]  # a TPU-layout cache keeps K and V together in k


def _page_axis(kv: KVCache) -> int:
    return 0 if layout_of(kv.v[0]) == PAGES_INTERLEAVED else 1


@functools.partial(jax.jit, static_argnames=("page_axis",))
def gather_pages(kv: KVCache, pages: jax.Array, page_axis: int) -> jax.Array:
    """[len(pages), arrays, ...]: each page's K/V of every layer, as stored (dtype and layout)."""
    return jnp.stack([jnp.moveaxis(jnp.take(a, pages, axis=page_axis), page_axis, 0) for a in _arrays(kv)], axis=1)


@functools.partial(jax.jit, static_argnames=("page_axis",))
def gather_chunks(kv: KVCache, pages: jax.Array, page_axis: int) -> tuple[jax.Array, ...]:
    """pages [chunks, chunk_pages]: one array of gather_pages' per chunk, from one program (one dispatch for a flush's
    chunks: one a chunk cost ~0.2-0.3 ms of the engine's thread each, 1B shape, H100, ~11 chunks a returning turn)."""
    everything = gather_pages(kv, pages.reshape(-1), page_axis=page_axis)
    return tuple(jnp.split(everything, pages.shape[0]))


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


def _scatter_chunks(
    kv: KVCache, pages: jax.Array, chunks: tuple[jax.Array, ...], rows: jax.Array, page_axis: int, from_host: bool
) -> tuple[KVCache, jax.Array]:
    """Rows of several chunks into the cache: chunk k's rows rows[k] into pages[k] (pages past the pool: dropped).
    from_host: the chunks are in host memory and the program copies them to the device itself, ordered with the
    steps."""
    if from_host:
        chunks = tuple(jax.device_put(c, jax.memory.Space.Device) for c in chunks)
    data = jnp.concatenate([c[r] for c, r in zip(chunks, rows, strict=True)])
    # the marker is ready once the call has run: its staging buffers (side_copy) may then be written again
    return _scatter_pages(kv, pages.reshape(-1), data, page_axis), jnp.max(pages)


# One call writes up to a power of two of chunks (each count compiled at warm-up): a load reads ~10 chunks and a
# poll writes several loads, and one call per chunk cost ~0.6 ms of the engine thread each (1B shape, H100: polls of
# ~50 ms with the steps waiting behind them). The cache is donated: written in place, as every step writes it.
scatter_chunks = jax.jit(_scatter_chunks, donate_argnums=(0,), static_argnames=("page_axis", "from_host"))
MAX_CALL_BYTES = 256 << 20  # chunk bytes one scatter call copies at most (its transient device memory, twice that)
MAX_CALL_CHUNKS = 32


@dataclasses.dataclass
class _ToDevice:
    # per chunk read: its device pages (padded with the pool's size: the scatter drops those), its rows for them
    parts: list[tuple[np.ndarray, np.ndarray]]
    slots: list[int]  # pinned in the tier until the load ends
    staged: list[jax.Array] | None  # each chunk on its way to the device (None: failed to start)
    started: float
    buffers: list[int] = dataclasses.field(default_factory=list)  # the staging buffers it holds (side stream)
    landings: list[side_copy.Landing] = dataclasses.field(default_factory=list)  # its side-stream copies' ends


@dataclasses.dataclass
class _Prefetch:  # copies started at arrival ("arrival")
    slots: list[int]  # pinned until its load takes them
    copies: dict[int, jax.Array]  # chunk -> its copy on the device
    size: int  # device bytes
    buffers: list[int]
    landings: list[side_copy.Landing]


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
        self.page_shape, self.page_dtype = page.shape[1:], page.dtype
        page_bytes = page.size * page.dtype.itemsize
        capacity = HostTier.capacity_for(int(size_gib * GIB), page_bytes)
        if capacity < 1:
            raise ValueError(
                f"kv_offloading_size: {size_gib} GiB holds no K/V page ({page_bytes} bytes each); "
                f"give at least {page_bytes / GIB:.6f} GiB"
            )
        # a chunk is at most 1/16 of the tier: eviction, a chunk at a time, stays fine-grained in a small tier
        most = chunk_pages_setting(os.environ.get("CAPSTAN_KV_OFFLOAD_CHUNK_PAGES"))
        self.chunk_pages = min(most, max(1, capacity // 16))
        self.tier = HostTier(page_bytes, capacity, self.chunk_pages)
        # chunks one scatter call writes at most: a power of two (each count is one compiled program)
        fit = min(MAX_CALL_CHUNKS, MAX_CALL_BYTES // (self.chunk_pages * page_bytes))
        self.max_call_chunks = 1 << max(0, fit.bit_length() - 1)
        self._on_host, self._on_device = self._page_shardings(kv)
        self._evicted: list[tuple[int, PageHash]] = []  # named by the pool, not yet gathered
        # copies to the host on their way: ((each chunk's slots, its page count), the copy of them all); committed in
        # order once done
        self._puts: collections.deque[tuple[list[tuple[list[int], int]], concurrent.futures.Future]]
        self._puts = collections.deque()
        # device_put to pinned host memory, off the engine's thread (why it stays: the module's docstring)
        self._put_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-to-host")
        if LOAD_WAY not in LOAD_WAYS:
            raise ValueError(f"CAPSTAN_KV_OFFLOAD_LOAD_WAY: {LOAD_WAY!r} is not one of {', '.join(LOAD_WAYS)}")
        self._direct = LOAD_WAY in ("direct", "same-step-direct")  # (read once: one tier's loads all go one way)
        self._wait_ready = LOAD_WAY == "staged"  # eager: the scatter waits for the copies on the device instead
        # the scheduler admits a sequence in the schedule that starts its load; the engine writes it before the step
        self.at_once = LOAD_WAY in ("same-step", "arrival", "same-step-direct")
        self.restore_headroom = restore_headroom_setting(os.environ.get("CAPSTAN_KV_OFFLOAD_RESTORE_HEADROOM"))
        self.prefetches = LOAD_WAY == "arrival"  # the scheduler calls `prefetch` as sequences arrive
        self.prefetch_max_bytes = int(prefetch_mib_setting(os.environ.get(PREFETCH_SETTING)) * (1 << 20))
        self._prefetched: dict[LoadKey, _Prefetch] = {}
        self._prefetched_bytes = 0
        self.prefetched_chunks_used = 0
        self._to_device: dict[LoadKey, _ToDevice] = {}
        self.bytes_to_host = self.bytes_to_device = 0
        self.pages_to_host = self.pages_to_device = 0
        self.failed_loads = self.skipped_to_host = 0
        self.load_seconds = 0.0  # from each load's start until its pages were written
        self.timings: collections.defaultdict[str, float] = collections.defaultdict(float)  # seconds by phase
        self.load_phases: collections.deque = collections.deque(maxlen=4096)  # s from start until written
        devices = sorted(self._on_device.device_set, key=lambda d: d.id)
        side = os.environ.get(SIDE_STREAM_SETTING, "0") == "1"
        if side and self._direct:  # (its staging buffers would be device memory nothing reads)
            raise ValueError(
                f"{SIDE_STREAM_SETTING}=1 works with the eager, staged, same-step and arrival load ways, not "
                f"CAPSTAN_KV_OFFLOAD_LOAD_WAY={LOAD_WAY}, whose scatter reads the chunks from host memory itself"
            )
        side = side and all(side_copy.available(d) for d in devices)
        self._side = side_copy.SideCopies(devices) if side else None
        self._staging: list[jax.Array] = []  # device buffers of a chunk each, taken now: nothing queued holds them
        if self._side is not None:
            mib = staging_mib_setting(os.environ.get(STAGING_SETTING))
            count = max(1, int(mib * (1 << 20)) // (self.chunk_pages * page_bytes))
            shape = (self.chunk_pages, *self.page_shape)
            with self._context():  # (each call's output is a buffer of its own)
                fresh = jax.jit(lambda: jnp.zeros(shape, self.page_dtype), out_shardings=self._on_device)
                self._staging = [fresh() for _ in range(count)]
            jax.block_until_ready(self._staging)
        self._free_staging: list[int] = list(range(len(self._staging)))
        self._staging_in_use: collections.deque[tuple[jax.Array, list[int]]] = collections.deque()  # (marker, bufs)
        self.side_copied_chunks = 0

    def _page_shardings(self, kv: KVCache):
        """A chunk's placement in host memory and on the device: the cache's split (by KV head) with the page axis
        first, arrays second."""
        sharding = kv.k[0].sharding
        if not isinstance(sharding, NamedSharding):  # one device
            device = next(iter(sharding.device_set))
            return SingleDeviceSharding(device, memory_kind=HOST_MEMORY), SingleDeviceSharding(device)
        spec = [*sharding.spec, *[None] * (kv.k[0].ndim - len(sharding.spec))]
        del spec[self.page_axis]
        on_host = NamedSharding(sharding.mesh, P(None, None, *spec), memory_kind=HOST_MEMORY)
        return on_host, NamedSharding(sharding.mesh, P(None, None, *spec))

    @property
    def busy(self) -> bool:
        """Loads wait to be written or copies to the host to be committed (the engine polls while this is true);
        evicted pages not gathered yet are not counted: the next read of the cache, which comes before any write,
        queues them."""
        return bool(self._to_device or self._puts)

    def _ready(self, load: _ToDevice) -> bool:
        if load.staged is None:
            return False
        if not self.at_once and not all(landing.done() for landing in load.landings):  # (at once: _write waits)
            return False
        if not self._wait_ready:  # the scatter reads host memory, or waits for the copies on the device
            return True
        return all(a.is_ready() for a in load.staged)  # type: ignore[attr-defined]

    @property
    def landed(self) -> bool:
        """Some load's pages are on the device, waiting for a poll to write them (a decode run ends for it)."""
        return any(self._ready(load) for load in self._to_device.values())

    def wait_landed(self, timeout_s: float) -> None:
        """Sleeps (the GIL released) until a load lands or timeout_s passes."""
        deadline = time.monotonic() + timeout_s
        while self._to_device and not self.landed and time.monotonic() < deadline:
            time.sleep(0.0005)

    # ---- device -> host ------------------------------------------------------------------------------------
    def on_evict(self, page: int, h: PageHash) -> None:
        """PagePool's hook: page, named h, is about to get a new owner; its bytes are copied before it is written."""
        self._evicted.append((page, h))

    def flush(self, kv: KVCache) -> None:
        """Starts the copies of the pages evicted since the last flush (before anything writes the cache)."""
        if not self._evicted:
            return
        t = time.perf_counter()
        named_pages, self._evicted = self._evicted, []
        evicted, named = [], set()  # a hash named twice since the last flush is copied once (its first page)
        for p, h in named_pages:
            if h not in named and not self.tier.holds(h):
                named.add(h)
                evicted.append((p, h))
        chunks: list[tuple[list[int], int, np.ndarray]] = []  # (slots, page count, the device pages to gather)
        for start in range(0, len(evicted), self.chunk_pages):
            part = evicted[start : start + self.chunk_pages]
            slots = self.tier.reserve([h for _, h in part])
            if slots is None:  # every chunk is pinned by a load: these pages are recomputed when asked for
                self.skipped_to_host += len(part)
                continue
            pages = np.zeros(self.chunk_pages, np.int32)  # rows past the part: page 0's bytes, never read
            pages[: len(part)] = [p for p, _ in part]
            chunks.append((slots, len(part), pages))
        while chunks:  # a power of two of chunks a gather (each count compiled at warm-up)
            n = min(1 << (len(chunks).bit_length() - 1), self.max_call_chunks)
            call, chunks = chunks[:n], chunks[n:]
            g = time.perf_counter()
            try:
                with self._context():
                    gathered = gather_chunks(kv, np.stack([p for _, _, p in call]), page_axis=self.page_axis)
                self.timings["step_thread_flush_gather"] += time.perf_counter() - g
            except Exception:  # noqa: BLE001 - a failed copy only loses its pages from the tier
                log.exception("a K/V copy to host memory failed; its %d pages are not kept", sum(c for _, c, _ in call))
                for slots, _, _ in call:
                    self.tier.abandon(slots)
                continue
            g = time.perf_counter()
            put = self._put_thread.submit(jax.device_put, list(gathered), self._on_host)
            self.timings["step_thread_flush_handoff"] += time.perf_counter() - g
            self._puts.append(([(slots, count) for slots, count, _ in call], put))
        self.timings["step_thread_flush"] += time.perf_counter() - t
        self._commit_puts()

    def _commit_puts(self) -> None:
        """Commits the copies to the host that are done, in the order they started (the tier finds them then)."""
        while self._puts and self._puts[0][1].done():
            chunks, put = self._puts.popleft()
            try:
                copies = put.result()
            except Exception:  # noqa: BLE001 - a failed copy only loses its pages from the tier
                log.exception("a K/V copy to host memory failed; its %d pages are not kept", sum(c for _, c in chunks))
                for slots, _ in chunks:
                    self.tier.abandon(slots)
                continue
            for (slots, count), on_host in zip(chunks, copies, strict=True):
                self.tier.commit(slots, on_host)  # a load reading it before it has landed waits for it on the device
                self.pages_to_host += count
                self.bytes_to_host += count * self.tier.page_bytes

    # ---- host -> device ------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """The tier's slots of the longest run of hashes it holds (marked most recently used)."""
        self._commit_puts()
        return self.tier.match(hashes)

    def prefetch(self, key: LoadKey, slots: Sequence[int]) -> None:
        """key's load will read these slots: their chunks start copying to the device now, if they fit in
        prefetch_max_bytes (pinned until the load takes them or `drop_prefetch`)."""
        if key in self._prefetched or not slots:
            return
        chunk_ids = list(dict.fromkeys(slot // self.chunk_pages for slot in slots))
        size = len(chunk_ids) * self.chunk_pages * self.tier.page_bytes
        if self._prefetched_bytes + size > self.prefetch_max_bytes:
            return
        t = time.perf_counter()
        slots = list(slots)
        self.tier.pin(slots)
        data = {chunk: copy for chunk, copy, _ in self.tier.read([c * self.chunk_pages for c in chunk_ids])}
        try:
            copies, buffers, landings = self._copy_to_device([data[c] for c in chunk_ids])
        except Exception:  # noqa: BLE001 - its load copies them itself
            log.exception("a K/V copy from host memory failed to start; its load tries again")
            self.tier.unpin(slots)
            return
        self._prefetched[key] = _Prefetch(slots, dict(zip(chunk_ids, copies, strict=True)), size, buffers, landings)
        self._prefetched_bytes += size
        self.timings["step_thread_prefetch"] += time.perf_counter() - t

    def drop_prefetch(self, key: LoadKey) -> None:
        """key's copies started at arrival are given up: their slots unpinned, their staging buffers free."""
        found = self._take_prefetch(key)
        if found is not None:
            self._free_staging += found.buffers  # (a copy still landing in one is ordered before any later one)

    def _take_prefetch(self, key: LoadKey) -> _Prefetch | None:
        found = self._prefetched.pop(key, None)
        if found is not None:
            self.tier.unpin(found.slots)
            self._prefetched_bytes -= found.size
        return found

    def _take_staging(self) -> int | None:
        """A free staging buffer (one whose last reader has run), or None."""
        if not self._free_staging:
            while self._staging_in_use and self._staging_in_use[0][0].is_ready():  # type: ignore[attr-defined]
                self._free_staging += self._staging_in_use.popleft()[1]
        return self._free_staging.pop() if self._free_staging else None

    def _copy_to_device(self, chunks: list[jax.Array]) -> tuple[list[jax.Array], list[int], list[side_copy.Landing]]:
        """Starts each host chunk's copy to the device: on the side stream into a staging buffer where one is free
        and the chunk's own copy to the host has landed, else by device_put (which waits for the queued programs).
        Returns the device arrays, the staging buffers taken and the side copies' ends."""
        out: list[jax.Array | None] = [None] * len(chunks)
        buffers: list[int] = []
        pairs = []
        for i, chunk in enumerate(chunks):
            b = self._take_staging() if self._side is not None and chunk.is_ready() else None  # type: ignore[attr-defined]
            if b is not None:
                buffers.append(b)
                pairs.append((chunk, self._staging[b]))
                out[i] = self._staging[b]
        landings: list[side_copy.Landing] = []
        try:
            if pairs:
                assert self._side is not None, "staging buffers are taken only with a side stream"
                landings.append(self._side.copy(pairs))
                self.side_copied_chunks += len(pairs)
            rest = [i for i, a in enumerate(out) if a is None]
            for i, a in zip(rest, jax.device_put([chunks[i] for i in rest], self._on_device), strict=True):
                out[i] = a
        except Exception:
            self._free_staging += buffers  # (a copy queued in one lands before any later one into it)
            raise
        return out, buffers, landings  # type: ignore[return-value]

    def start_load(self, key: LoadKey, pages: Sequence[int], slots: Sequence[int]) -> bool:
        """Starts copying the slots' pages to the device pages `pages`; `poll` reports key when they are written.
        False: the copy failed to start (the poll reports it failed; `at_once`: cancel it and recompute)."""
        t = time.perf_counter()
        slots = list(slots)
        self.tier.pin(slots)
        chunks: dict[int, tuple[jax.Array, list[tuple[int, int]]]] = {}  # chunk -> its copy, (device page, row)s
        for page, (chunk, data, row) in zip(pages, self.tier.read(slots), strict=True):
            chunks.setdefault(chunk, (data, []))[1].append((page, row))
        parts = []
        for _, wanted in chunks.values():
            dest = np.full(self.chunk_pages, self.num_pages, np.int32)  # past the pool: the scatter drops them
            rows = np.zeros(self.chunk_pages, np.int32)
            dest[: len(wanted)], rows[: len(wanted)] = zip(*wanted, strict=True)
            parts.append((dest, rows))
        found = self._take_prefetch(key)  # (its slots are pinned by this load now)
        ready = found.copies if found is not None else {}
        buffers = found.buffers if found is not None else []
        landings = found.landings if found is not None else []
        try:
            if self._direct:
                staged = [data for data, _ in chunks.values()]
            else:
                missing = [c for c in chunks if c not in ready]
                copies, taken, landed = self._copy_to_device([chunks[c][0] for c in missing])
                buffers, landings = buffers + taken, landings + landed
                put = dict(zip(missing, copies, strict=True))
                staged = [ready[c] if c in ready else put[c] for c in chunks]
                self.prefetched_chunks_used += len(chunks) - len(missing)
        except Exception:  # noqa: BLE001 - the poll reports it failed: recompute instead
            log.exception("a K/V copy from host memory failed to start; its pages are recomputed")
            staged = None
        self._to_device[key] = _ToDevice(parts, slots, staged, time.monotonic(), buffers, landings)
        self.timings["step_thread_start_load"] += time.perf_counter() - t
        if staged is None and self.at_once:  # (the caller cancels it; a load that waits is counted at the poll)
            self.failed_loads += 1
        return staged is not None

    def cancel(self, key: LoadKey) -> None:
        """The waiting sequence is gone (aborted): its pages are never written."""
        load = self._to_device.pop(key, None)
        if load is not None:
            self.tier.unpin(load.slots)
            self._free_staging += load.buffers  # (never given to a scatter; later copies into them land after)

    def poll(self, read_kv: Callable[[], KVCache]) -> tuple[KVCache | None, list[tuple[LoadKey, bool]]]:
        """Finishes the loads that are ready: the cache with the loaded pages written (None when no load landed:
        the cache was not read, so a queued decode dispatch was not waited for), and (key, loaded) for each load that
        ended (False: failed or late, so its pages are to be recomputed)."""
        t = time.perf_counter()
        self._commit_puts()
        kv: KVCache | None = None
        ended: list[tuple[LoadKey, bool]] = []
        parts: list[tuple[np.ndarray, np.ndarray, jax.Array]] = []  # every written load's (pages, rows, chunk)
        written: list[_ToDevice] = []
        for key, load in list(self._to_device.items()):
            # dropped, whatever (a load written at once is written in the step it started: it is never late)
            failed = load.staged is None or not self.at_once and time.monotonic() - load.started > LOAD_DEADLINE_S
            if not failed and not self._ready(load):
                continue
            del self._to_device[key]
            self.tier.unpin(load.slots)
            if failed:
                self.failed_loads += 1
                self._free_staging += load.buffers
                ended.append((key, False))
                continue
            assert load.staged is not None
            parts += [(dest, rows, chunk) for (dest, rows), chunk in zip(load.parts, load.staged, strict=True)]
            self.pages_to_device += len(load.slots)
            self.bytes_to_device += len(load.slots) * self.tier.page_bytes
            written.append(load)
            ended.append((key, True))
        if parts:
            r = time.perf_counter()
            kv = read_kv()
            self.timings["step_thread_poll_read_kv"] += time.perf_counter() - r
            w = time.perf_counter()
            for load in written:  # side copies: on the host, before a program reads their buffers (GIL released)
                for landing in load.landings:
                    landing.wait()
            self.timings["step_thread_poll_side_wait"] += time.perf_counter() - w
            w = time.perf_counter()
            kv = self._write(kv, parts, [b for load in written for b in load.buffers])
            self.timings["step_thread_poll_write"] += time.perf_counter() - w
        now = time.monotonic()
        for load in written:
            self.load_seconds += now - load.started
            self.load_phases.append(now - load.started)
        self.timings["step_thread_poll"] += time.perf_counter() - t
        return kv, ended

    def _write(
        self, kv: KVCache, parts: list[tuple[np.ndarray, np.ndarray, jax.Array]], buffers: Sequence[int] = ()
    ) -> KVCache:
        """Scatters the parts (device pages, their chunk's rows, the chunk) in calls of a power of two of them (a
        call short of one padded with parts whose pages are past the pool: one dispatch, ~0.5 ms of the engine's
        thread, instead of one per set bit); the staging buffers they read are free again once the last call has
        run."""
        with self._context():
            while parts:
                n = min(len(parts), self.max_call_chunks)  # (max_call_chunks: a power of 2)
                if self._direct:  # (a padding chunk would be copied from host memory for nothing)
                    n = 1 << (n.bit_length() - 1)
                call, parts = parts[:n], parts[n:]
                past = np.full(self.chunk_pages, self.num_pages, np.int32)
                call += [(past, past * 0, call[0][2])] * ((1 << (n - 1).bit_length()) - n)
                dest, rows = np.stack([d for d, _, _ in call]), np.stack([r for _, r, _ in call])
                chunks = tuple(c for _, _, c in call)
                kv, marker = scatter_chunks(kv, dest, chunks, rows, page_axis=self.page_axis, from_host=self._direct)
        if buffers:
            self._staging_in_use.append((marker, list(buffers)))
        return kv

    def timing_summary(self) -> dict:
        """The engine thread's seconds by phase, and loads' p50/p99 from start until their pages were written."""
        out = {k: round(v, 4) for k, v in sorted(self.timings.items())}
        if self.load_phases:
            written = np.asarray(self.load_phases)
            out["load_written_p50_ms"] = round(float(np.percentile(written, 50)) * 1000, 2)
            out["load_written_p99_ms"] = round(float(np.percentile(written, 99)) * 1000, 2)
        out["skipped_to_host_pages"] = self.skipped_to_host
        out["prefetched_chunks_used"] = self.prefetched_chunks_used
        out["side_copied_chunks"] = self.side_copied_chunks
        return out

    def _grow_pinned_pool(self, chunk: jax.Array) -> None:
        """Takes the tier's bytes of pinned host memory from the runtime once, then gives them back to its pool:
        the runtime pins host memory as its pool grows (cudaHostAlloc, seconds a few GiB, stalling the device's
        work), so a tier filling while serving would stall the steps each time the pool grew."""
        t = time.perf_counter()
        try:
            held = [jax.device_put(chunk, self._on_host) for _ in range(self.tier.num_chunks)]
            jax.block_until_ready(held)
        except Exception as e:  # (XlaRuntimeError: the runtime's pinned pool has a limit, and so has the host)
            size = self.tier.capacity * self.tier.page_bytes / GIB
            raise ValueError(
                f"kv_offloading_size: {size:.1f} GiB of pinned host memory could not be allocated ({e}); "
                "give a smaller size"
            ) from e
        del held  # (the pool keeps the memory pinned for the tier's copies)
        self.timings["warmup_pinned_pool"] = time.perf_counter() - t

    def warmup(self, kv: KVCache) -> KVCache:
        """Compiles every copy shape (a scatter of pages past the pool writes nothing)."""
        with self._context():
            kv = self._warmup(kv)
        jax.block_until_ready(kv)
        return kv

    def _warmup(self, kv: KVCache) -> KVCache:
        pages = np.zeros(self.chunk_pages, np.int32)
        n = 1
        while n <= self.max_call_chunks:  # every gather flush makes
            [gathered, *_] = gather_chunks(kv, np.zeros((n, self.chunk_pages), np.int32), page_axis=self.page_axis)
            n *= 2
        on_host = jax.device_put(gathered, self._on_host)
        if PREALLOCATE and jax.default_backend() != "cpu":
            self._grow_pinned_pool(gathered)
        past = np.full(self.chunk_pages, self.num_pages, np.int32)
        chunk = on_host if self._direct else jax.device_put(on_host, self._on_device)
        n = 1
        while n <= self.max_call_chunks:  # every call size _write makes
            kv = self._write(kv, [(past, pages, chunk)] * n)
            n *= 2
        return kv
