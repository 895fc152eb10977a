"""The tensor-parallel step's all-reduce alone: a chain of CHAIN all-reduces of bf16 [rows, 4096] over the model axis
(the 8B shape's two a layer), each after a small elementwise op so they cannot merge, against the same chain without
the all-reduces; prints us per all-reduce. A TP=2 decode step holds 65 (RESULTS.md: ~17 us each at 256 rows on an
H200 x2, 1.1 ms of an 8.2 ms step): XLA or NCCL options that shorten them show here in seconds, without compiling
the 8B shape (`ALLREDUCE_FLAGS="'' '--xla_gpu_...=true'" bash benchmarks/gpu_suite.sh allreduce`, one process each).

--processes N: the same chain over N processes of one GPU each (jax.distributed on 127.0.0.1, as vLLM runs a worker
per GPU) instead of one process driving N GPUs, the engine's way: whether the single-process collectives are what
idles a TP=2 step.

python benchmarks/all_reduce.py [--devices 2] [--processes 1] [--rows 1 256 2048] [--chain 64]
(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu, or JAX_PLATFORMS=cpu --processes 2
with gloo's collectives: a check that it runs)"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))
from processes import JOINED, join, run_joined  # noqa: E402
from timing import median_ms  # noqa: E402

AXIS = "model"
EMBED = 4096  # the 8B shape's hidden size


def chain(x: jax.Array, links: int, reduce: bool) -> jax.Array:
    """links rounds of a scale-and-shift, each followed by an all-reduce over AXIS when reduce (per device)."""
    for _ in range(links):
        x = x * jnp.asarray(0.5, x.dtype) + jnp.asarray(1.0, x.dtype)
        if reduce:
            x = jax.lax.psum(x, AXIS)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--processes", type=int, default=1, help="1: one process drives --devices; N: N devices, one each")
    ap.add_argument(JOINED, action="store_true", help=argparse.SUPPRESS)  # a process run_joined started
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 256, 2048])
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    a.devices = a.processes if a.processes > 1 else a.devices  # a device each
    if a.processes > 1 and not a.joined:
        sys.exit(run_joined(a.processes, sys.argv, timeout_s=600))
    if a.joined:
        join()
    if len(jax.devices()) < a.devices:
        sys.exit(f"--devices {a.devices}: only {len(jax.devices())} {jax.default_backend()} devices here")
    mesh = jax.make_mesh((a.devices,), (AXIS,), devices=jax.devices()[: a.devices])
    say = print if jax.process_index() == 0 else (lambda *_, **__: None)
    flags = os.environ.get("XLA_FLAGS", "") or "(no XLA_FLAGS)"
    nccl = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")) or "(no NCCL_*)"
    say(f"{jax.devices()[0].device_kind} x{a.devices} in {jax.process_count()} process(es), {flags}, {nccl}")
    for rows in a.rows:
        per = {}
        for reduce in (True, False):
            fn = jax.jit(
                jax.shard_map(
                    lambda x, reduce=reduce: chain(x, a.chain, reduce),
                    mesh=mesh,
                    in_specs=P(AXIS),  # each device its own rows: a real all-reduce, not a psum of equal values
                    out_specs=P(AXIS),
                    check_vma=False,
                )
            )
            shape = (a.devices * rows, EMBED)  # each process makes its own devices' rows
            ones = np.ones(shape, jnp.bfloat16)
            x = jax.make_array_from_callback(shape, NamedSharding(mesh, P(AXIS)), ones.__getitem__, dtype=jnp.bfloat16)
            compiled = fn.lower(x).compile()
            if reduce:  # what XLA made of the chain: its all-reduces, counted in the optimized HLO
                text = compiled.as_text() or ""
                found = text.count(" all-reduce(") + text.count(" all-reduce-start(")
            per[reduce] = median_ms(compiled, x, repeats=a.repeats)
        us = 1000 * (per[True] - per[False]) / a.chain
        say(
            f"bf16 [{rows:5d}, {EMBED}] ({rows * EMBED * 2 / 2**20:6.2f} MiB): {us:7.2f} us an all-reduce "
            f"({per[True]:.3f} ms the chain of {a.chain}, {per[False]:.3f} ms without; {found} all-reduces in the HLO)",
            flush=True,
        )


if __name__ == "__main__":
    main()
