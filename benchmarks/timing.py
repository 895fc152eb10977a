"""Device timing for benchmarks: the median of repeated calls, each waited for, after one warm-up call."""

from __future__ import annotations

import statistics
import time

import jax


def median_ms(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))  # compiles, and warms caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)
