"""The engine thread's host time for the host tier's calls (issue 33): what a returning turn's load costs the step
loop before the step that admits it is dispatched, call by call, on a shape's K/V cache (random bytes):

    python benchmarks/tier_calls.py --shape llama-3.2-1b        # on the GPU (seconds)
    python benchmarks/tier_calls.py --shape tiny --pages 64     # CPU (runs; the figures mean little)

Each figure is the median over --repeats of the time the call takes to return (its device work is waited for outside
the timing), ms: device_put of N chunks in pinned host memory to the device in one call; a flush's gathers of N
chunks of evicted pages, one call a chunk against gather_chunks' one call; a poll's scatter of N chunks; the
device_put then the scatter at once (as LOAD_WAY same-step does), returned and done (copy and scatter on the device);
a copy out to pinned host memory (device_put) of chunks already computed, and of a gather just dispatched (does the
engine thread wait for the gather, or for the copy?); the scatter dispatched right behind a program of --busy-ms
that writes the cache (as a decode dispatch under way does in the engine), with the cache donated as the engine's
scatter does and not, and the direct scatter (from host memory) behind it: whether dispatching a poll's scatter
waits on the host for the work queued before it."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402

from capstan.runtime.kv import host_offload  # noqa: E402
from capstan.runtime.kv.cache import KVCache  # noqa: E402


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median ms until fn returns (what it dispatched is waited for after each timing)."""
    jax.block_until_ready(fn())  # the first call compiles
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--pages", type=int, default=4096, help="device pool pages")
    ap.add_argument("--chunks", type=int, nargs="*", default=[1, 11, 44])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--busy-ms", type=float, default=15.0, help="device time of the program queued before a scatter")
    a = ap.parse_args()
    cfg = shape_config(a.shape)
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    kv = KVCache.allocate(cfg.num_layers, a.pages, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
    kv = jax.device_put(kv, jax.devices()[0])
    offload: host_offload.HostOffload[int] = host_offload.HostOffload(kv, 2.0)
    kv = offload.warmup(kv)
    cp, axis = offload.chunk_pages, offload.page_axis
    chunk = host_offload.gather_pages(kv, np.arange(cp, dtype=np.int32), page_axis=axis)
    on_host = jax.device_put(chunk, offload._on_host)
    print(f"{a.shape} {dtype} on {jax.devices()[0].device_kind}: chunks of {cp} pages, {chunk.nbytes >> 20} MiB each")
    rng = np.random.default_rng(0)
    busy, kv = busy_program(kv, a.busy_ms)
    for n in a.chunks:
        hosts = [jax.device_put(on_host, offload._on_host) for _ in range(n)]  # n arrays, as n tier chunks are
        pages = [rng.integers(0, a.pages, cp).astype(np.int32) for _ in range(n)]

        def put(hosts=hosts):
            return jax.device_put(hosts, offload._on_device)

        def gather_each(pages=pages):  # as flush called it before gather_chunks: a call a chunk
            return [host_offload.gather_pages(kv, p, page_axis=axis) for p in pages]

        row = {"device_put_one_call": timed(put, a.repeats), "gather_a_call_a_chunk": timed(gather_each, a.repeats)}

        def gather_chunks(pages=pages):  # as flush calls it: a power of two of chunks a call
            out, left = [], pages
            while left:
                k = min(1 << (len(left).bit_length() - 1), offload.max_call_chunks)
                out += host_offload.gather_chunks(kv, np.stack(left[:k]), page_axis=axis)
                left = left[k:]
            return out

        row["gather_chunks"] = timed(gather_chunks, a.repeats)
        on_device = jax.device_put(hosts, offload._on_device)

        # a copy out started on the engine thread: of chunks already computed, and of a gather just dispatched
        def copy_out_of_ready(on_device=on_device):
            return jax.device_put(on_device, offload._on_host)

        row["copy_out_of_ready_chunks"] = timed(copy_out_of_ready, a.repeats)
        row["copy_out_right_after_gather"] = timed(lambda: jax.device_put(gather_chunks(), offload._on_host), a.repeats)
        past = np.full(cp, a.pages, np.int32)  # pages past the pool: the scatter writes nothing (kv stays valid)
        rows = np.arange(cp, dtype=np.int32)

        def scatter(on_device=on_device, past=past, rows=rows):
            nonlocal kv
            kv = offload._write(kv, [(past, rows, c) for c in on_device])
            return kv

        row["scatter"] = timed(scatter, a.repeats)

        def put_then_scatter(hosts=hosts, past=past, rows=rows):  # the copies still in flight: does the host wait?
            nonlocal kv
            kv = offload._write(kv, [(past, rows, c) for c in jax.device_put(hosts, offload._on_device)])
            return kv

        row["put_then_scatter"] = timed(put_then_scatter, a.repeats)
        row["put_then_scatter_done"] = timed(lambda: jax.block_until_ready(put_then_scatter()), a.repeats)

        def flush_then_scatter(pages=pages, on_device=on_device, past=past, rows=rows):  # a same-step schedule's calls
            nonlocal kv
            gathered = list(host_offload.gather_chunks(kv, np.stack(pages[: offload.max_call_chunks]), page_axis=axis))
            copy_out = offload._put_thread.submit(jax.device_put, gathered, offload._on_host)  # as flush does
            kv = offload._write(kv, [(past, rows, c) for c in on_device])
            return kv, copy_out

        def flush_then_scatter_returned():
            kv_out, copy_out = flush_then_scatter()
            return kv_out

        row["flush_then_scatter"] = timed(flush_then_scatter_returned, a.repeats)

        def measure_behind_busy(row=row, on_device=on_device, hosts=hosts, past=past, rows=rows):
            nonlocal kv  # (the cache is donated: each call's output is the cache from then on)
            kv = behind_busy(row, kv, offload, on_device, hosts, past, rows, busy, a.repeats)

        measure_behind_busy()
        print(f"{n} chunks, ms:", {k: round(v, 3) for k, v in row.items()}, flush=True)


def busy_program(kv: KVCache, busy_ms: float) -> tuple[Callable[[KVCache], KVCache], KVCache]:
    """A jitted program that writes the cache (donated) after about busy_ms of matmuls on the device; and the cache
    (its calls donated the one given)."""
    m = jax.device_put(np.eye(2048, dtype=np.float32), jax.devices()[0])

    def run(kv: KVCache, m: jax.Array, steps: int) -> KVCache:
        x = jax.lax.fori_loop(0, steps, lambda _, x: x @ m, m)  # (m is the identity: x stays finite)
        k0 = kv.k[0].at[(0,) * kv.k[0].ndim].add((x[0, 0] * 0).astype(kv.k[0].dtype))
        return KVCache((k0, *kv.k[1:]), kv.v, kv.page_size)

    fn = jax.jit(run, donate_argnums=(0,), static_argnums=(2,))
    steps = 8
    while True:  # double the loop until it runs busy_ms
        kv = jax.block_until_ready(fn(kv, m, steps))
        t = time.perf_counter()
        kv = jax.block_until_ready(fn(kv, m, steps))
        ms = (time.perf_counter() - t) * 1000
        if ms >= busy_ms or steps >= 1 << 16:
            break
        steps *= 2
    print(f"busy program: {ms:.1f} ms ({steps} matmuls of 2048)")
    return (lambda kv: fn(kv, m, steps)), kv


def behind_busy(row: dict, kv: KVCache, offload, on_device, hosts, past, rows, busy, repeats: int) -> KVCache:
    """Median ms for each scatter's dispatch to return when the busy program was dispatched just before it."""
    kept = jax.jit(host_offload._scatter_chunks, static_argnames=("page_axis", "from_host"))  # (not donated)
    axis = offload.page_axis

    def raw(scatter, chunks, from_host):  # one call of a scatter over all the chunks (pages past the pool)
        n = len(chunks)
        return lambda kv: scatter(
            kv, np.stack([past] * n), tuple(chunks), np.stack([rows] * n), page_axis=axis, from_host=from_host
        )[0]

    ways = {
        "scatter_behind_busy": lambda kv: offload._write(kv, [(past, rows, c) for c in on_device]),
        "scatter_not_donated_behind_busy": raw(kept, on_device, from_host=False),
        "direct_scatter_behind_busy": raw(host_offload.scatter_chunks, hosts, from_host=True),
    }

    def flush_then_scatter(kv):  # a same-step poll's calls: the gathers, their copy out on the thread, the scatter
        gathered = list(host_offload.gather_chunks(kv, np.stack([past] * len(on_device)).clip(0, 0), page_axis=axis))
        offload._put_thread.submit(jax.device_put, gathered, offload._on_host)  # (waits on its thread for the gather)
        return offload._write(kv, [(past, rows, c) for c in on_device])

    ways["flush_then_scatter_behind_busy"] = flush_then_scatter

    def copy_out_on_this_thread(kv):  # the gather, then its copy out started here instead of on the thread
        gathered = host_offload.gather_chunks(kv, np.stack([past] * len(on_device)).clip(0, 0), page_axis=axis)
        jax.device_put(list(gathered), offload._on_host)
        return kv

    ways["gather_and_copy_out_here_behind_busy"] = copy_out_on_this_thread
    for name, scatter in ways.items():
        kv = jax.block_until_ready(scatter(busy(kv)))  # (compiles this count of chunks)
        times = []
        for _ in range(repeats):
            kv = busy(kv)
            t = time.perf_counter()
            kv = scatter(kv)
            times.append(time.perf_counter() - t)
            kv = jax.block_until_ready(kv)
        row[name] = statistics.median(times) * 1000
    return kv


if __name__ == "__main__":
    main()
