"""Whether a copy between pinned host memory and the device overlaps a program computing on the device (issue 33).

The host tier's loads are `device_put`s of pinned_host arrays to the device, started while a step computes, in the
hope that the DMA runs beside it. This times, on one device: a busy program alone, the copy alone (one array and in
chunks, as the tier's loads), and both started together in either order, each array's readiness polled from the
host. Overlap: the copy is ready well before the busy program when started after it; serialized: only after it.

python benchmarks/copy_overlap.py --mib 1024 --chunk-mib 32 --busy-ms 100"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from capstan.runtime.kv import side_copy


class _Landed:
    """A side-stream copy's event, polled like an array."""

    def __init__(self, event: side_copy.Landing):
        self.event = event

    def is_ready(self) -> bool:
        return self.event.done()


def ready_times(arrays: dict[str, list], t0: float, timeout_s: float = 30.0) -> dict[str, float]:
    """ms from t0 until every array of each named group is ready (polled from the host)."""
    done: dict[str, float] = {}
    deadline = time.perf_counter() + timeout_s
    while len(done) < len(arrays) and time.perf_counter() < deadline:
        for name, group in arrays.items():
            if name not in done and all(a.is_ready() for a in group):
                done[name] = round((time.perf_counter() - t0) * 1000, 2)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="bytes copied each way")
    ap.add_argument("--chunk-mib", type=int, default=32, help="the tier's chunk size (8B shape: 32 MiB)")
    ap.add_argument("--busy-ms", type=float, default=100.0, help="the busy program's length, about")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    dev = jax.devices()[0]
    on_host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev)
    n_chunks = a.mib // a.chunk_mib
    elems = (a.chunk_mib << 20) // 2
    chunks_dev = [jnp.full((elems,), i, jnp.bfloat16) for i in range(n_chunks)]
    chunks_host = jax.device_put(chunks_dev, on_host)
    jax.block_until_ready(chunks_host)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4096, 4096)), jnp.bfloat16)

    def make_busy(iters: int):
        @jax.jit
        def busy(y):
            return jax.lax.fori_loop(0, iters, lambda _, z: jnp.tanh(z @ x), y)

        return busy

    probe = make_busy(10)
    probe(x).block_until_ready()
    t = time.perf_counter()
    probe(x).block_until_ready()
    per_iter = (time.perf_counter() - t) / 10
    busy = make_busy(max(1, int(a.busy_ms / 1000 / per_iter)))
    busy(x).block_until_ready()
    jax.block_until_ready(jax.device_put(chunks_host[:1], on_dev))
    jax.block_until_ready(jax.device_put(chunks_dev[:1], on_host))
    results: dict[str, list] = {}
    side = side_copy.SideCopies([dev]) if side_copy.available(dev) else None
    staging = [jnp.zeros_like(c) for c in chunks_dev] if side is not None else []
    jax.block_until_ready(staging)

    def record(name: str, value) -> None:
        results.setdefault(name, []).append(value)

    for _ in range(a.repeats):
        t0 = time.perf_counter()
        record("busy_alone", ready_times({"busy": [busy(x)]}, t0))
        t0 = time.perf_counter()
        record("to_device_alone", ready_times({"copy": jax.device_put(chunks_host, on_dev)}, t0))
        t0 = time.perf_counter()
        record("to_host_alone", ready_times({"copy": jax.device_put(chunks_dev, on_host)}, t0))
        t0 = time.perf_counter()
        b = busy(x)
        c = jax.device_put(chunks_host, on_dev)
        record("busy_then_to_device", ready_times({"busy": [b], "copy": c}, t0))
        t0 = time.perf_counter()
        c = jax.device_put(chunks_host, on_dev)
        b = busy(x)
        record("to_device_then_busy", ready_times({"busy": [b], "copy": c}, t0))
        t0 = time.perf_counter()
        b = busy(x)
        c = [jax.device_put(h, on_dev) for h in chunks_host]  # one call a chunk, as prefetches of several turns
        record("busy_then_to_device_one_call_a_chunk", ready_times({"busy": [b], "copy": c}, t0))
        t0 = time.perf_counter()
        b = busy(x)
        c = jax.device_put(chunks_dev, on_host)
        record("busy_then_to_host", ready_times({"busy": [b], "copy": c}, t0))
        t0 = time.perf_counter()
        b1 = busy(x)
        c = jax.device_put(chunks_host, on_dev)
        b2 = busy(x)  # a second step queued behind: does it wait for the copy?
        record("busy_to_device_busy", ready_times({"busy1": [b1], "copy": c, "busy2": [b2]}, t0))
        if side is not None:  # the copy on a stream of our own, into buffers allocated before
            t0 = time.perf_counter()
            b = busy(x)
            ev = side.copy(list(zip(chunks_host, staging, strict=True)))
            record("busy_then_side_stream_copy", ready_times({"busy": [b], "copy": [_Landed(ev)]}, t0))
            t0 = time.perf_counter()
            b1 = busy(x)
            ev = side.copy(list(zip(chunks_host, staging, strict=True)))
            b2 = busy(x)
            record("busy_side_stream_copy_busy", ready_times({"busy1": [b1], "copy": [_Landed(ev)], "busy2": [b2]}, t0))
    if side is not None:
        ev.wait()
        same = all(bool(jnp.array_equal(s, d)) for s, d in zip(staging, chunks_dev, strict=True))
        print(f"side-stream copies equal their sources: {same}")
    print(f"{dev.device_kind}: {a.mib} MiB in {n_chunks} chunks of {a.chunk_mib} MiB, busy ~{a.busy_ms} ms")
    for name, runs in results.items():
        print(f"{name:40s} {json.dumps(runs[1:] if len(runs) > 1 else runs)}")  # (the first is a warm-up)


if __name__ == "__main__":
    main()
