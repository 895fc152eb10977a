"""Can XLA:GPU hide a tensor-parallel all-reduce under other work? Compiled for two GPUs on a machine with one.

A decode step at TP=2 spends ~1.1 ms of ~9.5 in 64 all-reduces, none overlapped (RESULTS.md, issue 31): each
depends on the matmul before it and feeds the one after. Splitting the rows in two independent halves gives the
scheduler something to run under each all-reduce. Whether XLA does it is a property of its compiled schedule, which
needs no second GPU to read: this script compiles a stack of Megatron MLP blocks (norm, column-split matmul,
row-split matmul, all-reduce, residual add) for a compile-only topology of two GPUs (jax.experimental.topologies,
the attached GPU's description) and prints, per variant and compiler options, how many all-reduces the schedule
holds and how much work runs between each one's start and its done.

    python3 benchmarks/tp_schedule.py [--rows 256] [--layers 8] [--dump DIR]
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "model"
# The attached GPU's description is what XLA needs to compile for it; the values that matter to the schedule
# are the compute capability and the cost model's inputs (cores, clocks, bandwidth).
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version { major: 12 minor: 8 patch: 0 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
device_description_str: "NVIDIA H200"
"""

# XLA's AllReduceCombiner merges independent all-reduces into one (the halves' two become one again), and its
# DotMerger merges dots that share an operand (the halves' matmuls against the same weights become one again)
APART: dict[str, str | bool] = {
    "xla_gpu_all_reduce_combine_threshold_bytes": "0",
    "xla_gpu_dot_merger_threshold_mb": "0",
}
OPTIONS: dict[str, dict[str, str | bool]] = {
    "defaults": {},
    "no combiner": {"xla_gpu_all_reduce_combine_threshold_bytes": "0"},
    "no combiner, no dot merger": APART,
    "that, latency-hiding scheduler": {**APART, "xla_gpu_enable_latency_hiding_scheduler": True},
}


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)).astype(x.dtype)


def block(x, w_in, w_out):
    """One Megatron MLP block on this device's columns: the partial sums meet in one all-reduce."""
    h = jax.nn.silu(rms(x) @ w_in)
    return x + jax.lax.psum(h @ w_out, AXIS)


def whole(x, w_ins, w_outs):
    for w_in, w_out in zip(w_ins, w_outs, strict=True):
        x = block(x, w_in, w_out)
    return x


def halves(x, w_ins, w_outs):
    """The rows in two independent halves: one half's all-reduce has the other half's matmuls to run under."""
    a, b = jnp.split(x, 2)
    for w_in, w_out in zip(w_ins, w_outs, strict=True):
        a = block(a, w_in, w_out)
        b = block(b, w_in, w_out)
    return jnp.concatenate([a, b])


def ordered_halves(x, w_ins, w_outs):
    """halves, with each half's matmuls ordered after the other's partial sums (an optimization barrier), so that
    no compiler pass can merge the two halves' matmuls back into one, whatever its options."""
    a, b = jnp.split(x, 2)
    for w_in, w_out in zip(w_ins, w_outs, strict=True):
        part_a = jax.nn.silu(rms(a) @ w_in) @ w_out
        b, part_a = jax.lax.optimization_barrier((b, part_a))
        part_b = jax.nn.silu(rms(b) @ w_in) @ w_out
        a, part_b = jax.lax.optimization_barrier((a + jax.lax.psum(part_a, AXIS), part_b))
        b = b + jax.lax.psum(part_b, AXIS)
    return jnp.concatenate([a, b])


GEMM = re.compile(r"= \S+ (fusion\(.*kind=kCustom, calls=%gemm|custom-call\(.*cublas)")


def overlap(text: str) -> tuple[int, int, list[int]]:
    """(all-reduce starts, synchronous all-reduces, matmuls between each start and its done) in the entry
    computation's schedule (an optimized module prints its instructions in schedule order)."""
    entry = text[text.index("\nENTRY ") :]
    open_: dict[str, int] = {}
    between: list[int] = []
    sync = 0
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?(\S+) = .*? all-reduce-start\(", line)
        if m:
            open_[m.group(1)] = 0
            continue
        m = re.search(r"all-reduce-done\(\S*?%?([\w.\-]+)\)", line)
        if m and m.group(1) in open_:
            between.append(open_.pop(m.group(1)))
            continue
        if re.search(r"= \S+ all-reduce\(", line):
            sync += 1
        if GEMM.search(line):
            for k in open_:
                open_[k] += 1
    return len(between), sync, between


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--embed", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dump", help="write each optimized module here")
    a = ap.parse_args()
    topo = topologies.get_topology_desc("tp2", "cuda", target_config=H200, topology="1x1x2")
    mesh = jax.sharding.Mesh(topo.devices, (AXIS,))
    print("devices:", topo.devices)
    bf16 = jnp.bfloat16
    x = jax.ShapeDtypeStruct((a.rows, a.embed), bf16, sharding=NamedSharding(mesh, P()))
    w_in = jax.ShapeDtypeStruct((a.embed, a.mlp), bf16, sharding=NamedSharding(mesh, P(None, AXIS)))
    w_out = jax.ShapeDtypeStruct((a.mlp, a.embed), bf16, sharding=NamedSharding(mesh, P(AXIS, None)))
    specs = (P(), [P(None, AXIS)] * a.layers, [P(AXIS, None)] * a.layers)
    for variant in (whole, halves, ordered_halves):
        f = jax.jit(jax.shard_map(variant, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False))
        lowered = f.lower(x, [w_in] * a.layers, [w_out] * a.layers)
        for name, options in OPTIONS.items():
            text = lowered.compile(compiler_options=options).as_text()
            assert text is not None
            if a.dump:
                with open(f"{a.dump}/{variant.__name__}-{re.sub(r'[^a-z]+', '_', name)}.txt", "w") as out:
                    out.write(text)
            starts, sync, between = overlap(text)
            hidden = sum(1 for n in between if n > 0)
            print(
                f"{variant.__name__:14s} {name:31s} async all-reduces {starts:3d}, synchronous {sync:3d}; "
                f"with a matmul under them {hidden:3d}; matmuls under each: {between}"
            )


if __name__ == "__main__":
    main()
