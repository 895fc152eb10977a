"""The native CPU paged attention for float32 pages: runtime/kernels/cpu/paged_attention.cc, built into the block
matmul's library (cpu_block_matmul.build: `make setup`) and called from jitted programs through XLA FFI.

XLA's loops (attention/chunked.py) spend ~0.14 ms a layer of a one-row decode step on this 2-core machine in a
while loop's small ops (benchmarks/RESULTS.md, issue 66); the kernel reads each (token, kv head)'s pages once with
the kv head's query heads side by side, on the library's thread pool when a call has enough work. Its result is the
reference's (attention/reference.py); tests/test_cpu_paged_attention.py checks it.

Environment: CAPSTAN_CPU_NATIVE_ATTENTION=0 keeps XLA's loops."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_block_matmul

TARGET = "capstan_cpu_paged_attention"  # the FFI target's name in XLA's registry
FUSED_TARGET = "capstan_cpu_rope_write_attend"  # rope, the K/V write and attention in one call
ENABLED = os.environ.get("CAPSTAN_CPU_NATIVE_ATTENTION", "1") != "0"
# CAPSTAN_CPU_FUSED_ATTENTION=0 keeps rope and the K/V write as XLA's ops before the native attention
FUSED = os.environ.get("CAPSTAN_CPU_FUSED_ATTENTION", "1") != "0"
_registered = False


def available() -> bool:
    """Whether jitted programs can call the kernel: enabled, the library built and loaded, JAX's backend the CPU."""
    global _registered
    if not ENABLED or jax.default_backend() != "cpu":
        return False
    library = cpu_block_matmul.load()
    if library is None:
        return False
    if not _registered:
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.CapstanCpuPagedAttention), platform="cpu")
        jax.ffi.register_ffi_target(FUSED_TARGET, jax.ffi.pycapsule(library.CapstanCpuRopeWriteAttend), platform="cpu")
        _registered = True
    return True


def supported(dtype, kv_dtype) -> bool:
    """The kernel's dtypes: float32 queries and pages (bf16 and FP8 pages keep XLA's loops)."""
    return jnp.dtype(dtype) == jnp.float32 and jnp.dtype(kv_dtype) == jnp.float32


def paged_attention(
    q: jax.Array,  # [T, KVH, G, D] float32
    k_cache: jax.Array,  # [KVH, pages, page_size, D] float32 (one layer)
    v_cache: jax.Array,
    meta,
    *,
    scale: float,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:
    """attention.reference.paged_attention's result, in the native kernel."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    window = jnp.asarray(0 if window is None else window, jnp.int32).reshape(())
    return call(
        q,
        k_cache,
        v_cache,
        meta.block_tables.astype(jnp.int32),
        meta.token_seq.astype(jnp.int32),
        meta.positions.astype(jnp.int32),
        window,
        scale=np.float32(scale * k_scale),
        softcap=np.float32(softcap or 0.0),
        v_scale=np.float32(v_scale),
    )


def rope_write_attend(
    qkv: jax.Array,  # [T, KVH, G + 2, D] float32: each kv head's G queries, its key, its value
    cos: jax.Array,  # [T, D]
    sin: jax.Array,
    k_cache: jax.Array,  # [KVH, pages, page_size, D] float32 (one layer)
    v_cache: jax.Array,
    meta,
    *,
    scale: float,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """models/layers.py's unfused path from the QKV projection to attention's out (rope on q and k, models/rope.py;
    k and v written to meta.slot_mapping, attention/reference.py's write_kv; then paged_attention) in one native
    call: (out [T, KVH, G, D], k_cache, v_cache), the pages written in place (the caches are aliased to the
    outputs). Float32 pages, no q/k norms (the caller checks: fused_supported)."""
    T, KVH, _, D = qkv.shape
    G = qkv.shape[2] - 2
    call = jax.ffi.ffi_call(
        FUSED_TARGET,
        (
            jax.ShapeDtypeStruct((T, KVH, G, D), jnp.float32),
            jax.ShapeDtypeStruct(k_cache.shape, jnp.float32),
            jax.ShapeDtypeStruct(v_cache.shape, jnp.float32),
        ),
        vmap_method="sequential",
        input_output_aliases={3: 1, 4: 2},
    )
    window = jnp.asarray(0 if window is None else window, jnp.int32).reshape(())
    out, k_cache, v_cache = call(
        qkv.astype(jnp.float32),
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        k_cache,
        v_cache,
        meta.block_tables.astype(jnp.int32),
        meta.token_seq.astype(jnp.int32),
        meta.positions.astype(jnp.int32),
        meta.slot_mapping.astype(jnp.int32),
        window,
        scale=np.float32(scale),
        softcap=np.float32(softcap or 0.0),
    )
    return out, k_cache, v_cache
