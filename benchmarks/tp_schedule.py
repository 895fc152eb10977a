"""Can XLA:GPU hide a tensor-parallel all-reduce under other work? Compiled for two GPUs on a machine with one.

A decode step at TP=2 spends ~1.1 ms of ~9.5 in 64 all-reduces, none overlapped (RESULTS.md, issue 31): each
depends on the matmul before it and feeds the one after. Splitting the rows in two independent halves gives the
scheduler something to run under each all-reduce. Whether XLA does it is a property of its compiled schedule, which
needs no second GPU to read: this script compiles a stack of Megatron MLP blocks (norm, column-split matmul,
row-split matmul, all-reduce, residual add) for a compile-only topology of two GPUs (jax.experimental.topologies,
the attached GPU's description) and prints, per variant and compiler options, how many all-reduces the schedule
holds and how much work runs between each one's start and its done.

    python3 benchmarks/tp_schedule.py [--rows 256] [--layers 8] [--dump DIR]
    python3 benchmarks/tp_schedule.py --shape llama-3-8b [--rows 256] [--pages 4096]

--shape: the engine's own decode forward instead (DecoderModel on a decode step of --rows rows, the fused decode
kernel included, abstract weights and pages split as TensorParallel splits them), whole and in two halves of rows
(models/decoder.py, CAPSTAN_DECODE_HALVES_MIN_ROWS) with and without HALVES_COMPILER_OPTIONS.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

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


def engine_decode(a, mesh) -> None:
    """The engine's decode forward at TP=2 for a shape, compiled whole and in halves."""
    import haliax as hax

    sys.path.insert(0, str(Path(__file__).parent))
    from shapes import shape_config

    from capstan.runtime.attention import AttentionMetadata
    from capstan.runtime.kv.cache import KVCache
    from capstan.runtime.models import decoder
    from capstan.runtime.models.loader import random_model
    from capstan.runtime.parallel.tensor_parallel import SPLIT_AXES

    cfg = shape_config(a.shape)
    model = jax.eval_shape(lambda: random_model(cfg, "bfloat16"))

    def placed(x):
        if isinstance(x, hax.NamedArray):
            spec = P(*(AXIS if ax.name in SPLIT_AXES else None for ax in x.axes))
            return hax.NamedArray(
                jax.ShapeDtypeStruct(x.array.shape, x.dtype, sharding=NamedSharding(mesh, spec)), x.axes
            )
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))

    model = jax.tree.map(placed, model, is_leaf=lambda x: isinstance(x, hax.NamedArray))
    pages = jax.ShapeDtypeStruct(
        (cfg.num_kv_heads, a.pages, 16, cfg.head_dim), jnp.bfloat16, sharding=NamedSharding(mesh, P(AXIS))
    )
    kv = KVCache((pages,) * cfg.num_layers, (pages,) * cfg.num_layers, 16)
    S = a.rows

    def rows(*shape: int) -> Any:  # an abstract step input (Any: AttentionMetadata's fields are arrays)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, P()))

    meta = AttentionMetadata(rows(S), rows(S), rows(S), rows(S, 64), rows(S), decode=True)

    def forward(model, kv, tokens, meta):
        hidden, kv = model(tokens, meta, kv)
        return hidden.array, kv

    for halves in (0, 2):
        decoder.HALVES_MIN_ROWS = halves
        jax.clear_caches()  # jit reuses a function's trace: the other variant's otherwise
        with jax.set_mesh(mesh):
            lowered = jax.jit(forward, donate_argnums=(1,)).lower(model, kv, rows(S), meta)
        for name, options in (("defaults", {}), ("HALVES_COMPILER_OPTIONS", decoder.HALVES_COMPILER_OPTIONS)):
            text = lowered.compile(compiler_options=options).as_text()
            assert text is not None
            starts, sync, between = overlap(text)
            print(
                f"{a.shape} {S} rows, {'halves' if halves else 'whole':6s} {name:23s} async all-reduces {starts:3d}, "
                f"synchronous {sync:3d}; with a matmul under them {sum(1 for n in between if n > 0):3d}; "
                f"matmuls under each (first 12): {between[:12]}"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--embed", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dump", help="write each optimized module here")
    ap.add_argument("--shape", help="the engine's decode forward of this benchmark shape (benchmarks/shapes.py)")
    ap.add_argument("--pages", type=int, default=4096, help="--shape: KV pages of 16 tokens")
    a = ap.parse_args()
    topo = topologies.get_topology_desc("tp2", "cuda", target_config=H200, topology="1x1x2")
    mesh = jax.sharding.Mesh(topo.devices, (AXIS,))
    print("devices:", topo.devices)
    if a.shape:
        return engine_decode(a, mesh)
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
