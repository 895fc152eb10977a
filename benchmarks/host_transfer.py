"""Host <-> device copies of K/V pages, by way each: what the prefix cache's host tier (issue 33) could move per copy.

The tier today keeps pages in numpy and loads them with `jax.device_put` of a staged numpy array (unpinned host
memory: the runtime copies it into a pinned buffer of its own before the DMA). JAX also places arrays in host
memory kinds ("pinned_host", "unpinned_host") and moves them to the device with `device_put` to a device sharding;
this times each way for a copy of N pages of a shape's K/V (every layer, K and V, bf16), median of --repeats:

    python benchmarks/host_transfer.py --shape llama-3-8b --pages 8 64       # on the GPU (a few seconds)
    python benchmarks/host_transfer.py --shape tiny --pages 8                # CPU (runs; the figures mean little)

Ways: numpy -> device (today's load), pinned_host -> device, numpy -> pinned_host (the host copy a pinned load
would add unless the tier stores pinned arrays), device -> numpy (np.asarray after copy_to_host_async: today's
eviction), device -> pinned_host, and the numpy gather of N scattered tier slots (today's staging)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402

PAGE_TOKENS = 16


def page_bytes(shape: str) -> tuple[tuple[int, ...], int]:
    cfg = shape_config(shape)
    # one page's K/V of every layer as the tier stores it: [layers x (K, V), tokens, kv heads, head_dim], bf16
    page = (cfg.num_layers * 2, PAGE_TOKENS, cfg.num_kv_heads, cfg.head_dim)
    return page, int(np.prod(page)) * 2


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # the first call compiles or allocates
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_ways(data, host_pinned, resident, tier, slots, on_device, pinned) -> dict[str, Callable[[], object]]:
    """Each way to move the same pages, as a call to time."""

    def to_numpy():  # a fresh device copy each call: an array already fetched keeps its host copy (np.asarray: free)
        fresh = jnp.copy(resident)
        fresh.copy_to_host_async()
        return np.asarray(fresh)

    return {
        "numpy -> device": lambda: jax.device_put(data, on_device).block_until_ready(),
        "pinned_host -> device": lambda: jax.device_put(host_pinned, on_device).block_until_ready(),
        "numpy -> pinned_host": lambda: jax.device_put(data, pinned).block_until_ready(),
        "device -> numpy": to_numpy,
        "device -> pinned_host": lambda: jax.device_put(resident, pinned).block_until_ready(),
        "numpy gather of tier slots": lambda: tier[slots],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--pages", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tier-pages", type=int, default=1024, help="slots of the numpy tier the gather reads from")
    args = ap.parse_args()

    dev = jax.devices()[0]
    on_device = SingleDeviceSharding(dev, memory_kind="device")
    pinned = SingleDeviceSharding(dev, memory_kind="pinned_host")
    page, nbytes = page_bytes(args.shape)
    print(f"{dev.device_kind}: {args.shape}, one page {nbytes / 2**20:.2f} MiB ({page}), median of {args.repeats}")
    tier = np.zeros((args.tier_pages, *page), np.uint16)  # bf16 bytes, as the first host_tier.py kept them (numpy)
    rng = np.random.default_rng(0)
    for n in args.pages:
        data = rng.integers(0, 2**16, (n, *page), dtype=np.uint16)
        host_pinned = jax.device_put(data, pinned)
        host_pinned.block_until_ready()
        resident = jax.device_put(data, on_device)
        resident.block_until_ready()
        slots = rng.choice(args.tier_pages, n, replace=False)

        ways = copy_ways(data, host_pinned, resident, tier, slots, on_device, pinned)
        size = n * nbytes
        for name, fn in ways.items():
            s = timed(fn, args.repeats)
            print(f"  {n:4d} pages ({size / 2**20:7.1f} MiB) {name:>28}: {s * 1e3:8.2f} ms  {size / s / 1e9:6.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
