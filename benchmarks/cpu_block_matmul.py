"""The native CPU block matmul (kernels/cpu_block_matmul.py) against XLA's loops (quantization.cpu_int8_matmul) on
SmolLM2-135M-Instruct's projection shapes, weights in Q4_1 blocks (the LM head in Q8_0, as cpu_layout.py makes it):

    python benchmarks/cpu_block_matmul.py                 # rows 1 4 16, both paths, ms per matmul (median)
    python benchmarks/cpu_block_matmul.py --rows 1 16 64 --isa avx2 --threads 1

Each timing is one jitted program running the matmul `--repeat` times in a loop (each input depends on the previous
output, so nothing is hoisted), divided by `--repeat`: the per-call dispatch stays out of it. Random weights: the
kernels' speed does not depend on the values."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from capstan.runtime.kernels import cpu_block_matmul
from capstan.runtime.models.cpu_block_weight import CpuBlockWeight
from capstan.runtime.models.quantization import QuantizedWeight, cpu_int8_matmul

# (name, k inputs, n outputs, Q4_1?): the brief's shapes, then the fused ones the model runs
SHAPES = [
    ("q/o 576x576", 576, 576, True),
    ("k/v 576x192", 576, 192, True),
    ("gate/up 576x1536", 576, 1536, True),
    ("down 1536x576", 1536, 576, True),
    ("qkv fused 576x960", 576, 960, True),
    ("gate_up fused 576x3072", 576, 3072, True),
    ("LM head 576x49152 (Q8_0)", 576, 49152, False),
]


def weight(k: int, n: int, q4_1: bool, rng) -> QuantizedWeight:
    out, inp, blocks = hax.Axis("out", n), hax.Axis("in", k), hax.Axis("in_blocks", k // 32)
    q = rng.integers(0, 16, (n, k)) if q4_1 else rng.integers(-127, 128, (n, k))
    scale = rng.uniform(0.001, 0.02, (n, k // 32)).astype(np.float32)
    return QuantizedWeight(
        hax.named(jnp.asarray(q, jnp.int8), (out, inp)),
        hax.named(jnp.asarray(scale), (out, blocks)),
        block=32,
        offset=hax.named(jnp.asarray(-8 * scale), (out, blocks)) if q4_1 else None,
    )


def timed(matmul, w, x, repeat: int, samples: int) -> float:
    """Median ms per matmul over `samples` runs of one program that does it `repeat` times."""

    @jax.jit
    def loop(w, x):
        def body(_, carry):
            x, acc = carry
            y = matmul(hax.named(x, ("token", "in")), w).array
            return x + 1e-30 * y[..., :1], acc + y[..., 0].sum()  # the next input depends on this output

        return jax.lax.fori_loop(0, repeat, body, (x, jnp.zeros((), jnp.float32)))[1]

    loop(w, x).block_until_ready()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        loop(w, x).block_until_ready()
        times.append((time.perf_counter() - start) / repeat * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--isa", default="", help="the native kernel's instruction set (default: the best)")
    parser.add_argument("--threads", type=int, default=None, help="the native kernel's threads (default: the host's)")
    args = parser.parse_args()
    assert cpu_block_matmul.available(), "build the native kernel first: make setup"
    cpu_block_matmul.configure(args.isa, args.threads)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    threads = args.threads or cpu_block_matmul.host_threads()
    print(f"load average {load}; native: {cpu_block_matmul.isa()}, {threads} threads; XLA: {os.cpu_count()} cores")
    rng = np.random.default_rng(0)
    print("| shape (k x n) | rows | XLA loops ms | native ms | speed-up |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, k, n, q4_1 in SHAPES:
        qw = weight(k, n, q4_1, rng)
        native = CpuBlockWeight.from_quantized(qw, contracted=1)
        for rows in args.rows:
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            xla = timed(lambda x, w: cpu_int8_matmul(x, w, "in"), qw, x, args.repeat, args.samples)
            mine = timed(lambda x, w: w(x, "in"), native, x, args.repeat, args.samples)
            print(f"| {name} | {rows} | {xla:.3f} | {mine:.3f} | {xla / mine:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
