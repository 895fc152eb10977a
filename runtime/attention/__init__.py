"""Paged attention: the plain-XLA reference defines correctness; faster kernels are chosen by backend."""

import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..kernels import cpu_paged_attention
from ..kernels.tpu_ragged_attention import HEADS_FIRST, PAGES_INTERLEAVED, split_pages, write_kv_pages
from ..parallel.mesh import MODEL_AXIS, model_parallel_size
from .chunked import chunked_attention
from .kv_quantization import is_fp8, scales_for
from .metadata import INVALID_SLOT, AttentionMetadata, query_blocks
from .reference import paged_attention, write_kv

# Tests set this to run the GPU kernels interpreted on CPU, so CI covers their wiring into the engine too.
KERNELS_INTERPRETED_ON_CPU = False
# Tests set this to lay the KV cache out as on TPUs, so CI covers that layout's path through the engine (its
# attention reads the split pages there: the TPU kernel does not run interpreted with this JAX).
TPU_LAYOUT_ON_CPU = False
# CAPSTAN_FUSED_DECODE=0 keeps GPU decode steps on separate norm, rope and K/V-write kernels before JAX's decode
# kernel (gpu_decode) instead of gpu_fused_decode's one kernel (benchmarks/RESULTS.md compares them)
FUSED_DECODE = os.environ.get("CAPSTAN_FUSED_DECODE", "1") != "0"


def kv_layout(backend: str, kv_heads: int, head_dim: int, dtype, tpu_version: int | None = None) -> str:
    """How one layer's pages are laid out: as JAX's TPU kernel reads them on TPUs (v4 on; None: this host's) and
    shapes it takes (kv_heads: one device's), else HEADS_FIRST. Chosen once, when the cache is allocated;
    attention follows the arrays it is given."""
    from ..kernels import tpu_ragged_attention as tpu_ragged

    if backend == "cpu" and TPU_LAYOUT_ON_CPU:
        return PAGES_INTERLEAVED
    if backend != "tpu" or not tpu_ragged.supported(kv_heads, head_dim, dtype):
        return HEADS_FIRST
    version = tpu_ragged.tpu_version() if tpu_version is None else tpu_version
    return PAGES_INTERLEAVED if version >= tpu_ragged.MIN_TPU_VERSION else HEADS_FIRST


def layout_of(v_cache: jax.Array) -> str:
    """PAGES_INTERLEAVED caches hold K and V in the k array; their v array is an empty placeholder."""
    return PAGES_INTERLEAVED if v_cache.size == 0 else HEADS_FIRST


def choose_kernel(
    backend: str,
    *,
    layout: str,
    decode: bool,
    ragged: bool,
    dtype,
    batch: int,
    kv_dtype=None,
    kv_heads: int,
    pages_per_seq: int,
    page_size: int,
    head_dim: int,
    window: int | None,
    softcap,
) -> str:
    """The kernel for one layer's step: "tpu_ragged", "gpu_decode", "gpu_ragged", "cpu_native" (float32 pages where
    `make setup` built the native kernel) or "chunked" (the reference's result over the real context). ragged: the
    step carries query blocks (the batch builder's steps do). dtype: the queries'; kv_dtype: the pages' (None: the
    same). JAX's decode kernel reads pages of the queries' dtype, or
    FP8 ones (it upcasts them after the load); our kernels upcast any cache dtype after the load."""
    from ..kernels.gpu_decode_attention import supported as decode_supported
    from ..kernels.gpu_ragged_attention import supported as ragged_supported

    if layout == PAGES_INTERLEAVED:
        return "tpu_ragged" if backend == "tpu" and (decode or ragged) else "chunked"
    if backend == "gpu":
        dtype = jnp.dtype(dtype)
        kv_dtype = dtype if kv_dtype is None else jnp.dtype(kv_dtype)
        if (
            decode
            and window is None
            and not softcap
            and dtype != jnp.float32
            and (kv_dtype == dtype or is_fp8(kv_dtype))
            and decode_supported(batch, kv_heads, pages_per_seq, page_size, head_dim)
        ):
            return "gpu_decode"
        if (decode or ragged) and ragged_supported(head_dim, page_size, dtype.itemsize):
            return "gpu_ragged"
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if backend == "cpu" and cpu_paged_attention.supported(dtype, kv_dtype) and cpu_paged_attention.available():
        return "cpu_native"
    return "chunked"


def attend(
    q,
    k_cache,
    v_cache,
    meta: AttentionMetadata[jax.Array],
    *,
    scale: float,
    window: int | None,
    softcap,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """Chooses the kernel at trace time (choose_kernel). On GPUs: bf16 decode batches of layers without a window
    or soft-capping take JAX's Pallas decode kernel (it splits long contexts across blocks), every other step our
    ragged Pallas kernel (prefill chunks with their cached context, mixed with decode tokens; float32 decode too,
    since JAX's kernel multiplies in TF32). On TPUs, caches in the kernel's layout: JAX's ragged Pallas kernel.
    Elsewhere, and for shapes the kernels cannot tile, the reference's result computed over the step's real
    context only (chunked_attention), not over max_model_len keys; on CPUs with float32 pages, the native kernel
    (kernels/cpu_paged_attention.py) computes that result where it is built. k_scale, v_scale: an FP8 cache's
    (kv_quantization); every kernel upcasts the pages after the load and applies them in float32."""
    backend = jax.default_backend()
    if backend == "cpu" and KERNELS_INTERPRETED_ON_CPU:
        backend = "gpu"
    layout = layout_of(v_cache)
    page_size = k_cache.shape[1] if layout == PAGES_INTERLEAVED else k_cache.shape[2]
    kernel = choose_kernel(
        backend,
        layout=layout,
        decode=meta.decode,
        ragged=meta.query_blocks is not None,
        dtype=q.dtype,
        kv_dtype=k_cache.dtype,
        batch=q.shape[0],
        kv_heads=q.shape[1],
        pages_per_seq=meta.block_tables.shape[1],
        page_size=page_size,
        head_dim=q.shape[-1],
        window=window,
        softcap=softcap,
    )
    interpret = jax.default_backend() != "gpu"
    if kernel == "cpu_native":
        return cpu_paged_attention.paged_attention(
            q, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale
        )
    if kernel == "tpu_ragged":
        from ..kernels.tpu_ragged_attention import ragged_attention as tpu_ragged_attention

        return tpu_ragged_attention(
            q, k_cache, meta, scale=scale, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale
        )
    if kernel == "gpu_decode":
        from ..kernels.gpu_decode_attention import decode_attention

        return decode_attention(
            q, k_cache, v_cache, meta, scale=scale, k_scale=k_scale, v_scale=v_scale, interpret=interpret
        )
    if kernel == "gpu_ragged":
        from ..kernels.gpu_ragged_attention import ragged_attention as gpu_ragged_attention

        return gpu_ragged_attention(
            q,
            k_cache,
            v_cache,
            meta,
            scale=scale,
            window=window,
            softcap=softcap or None,
            k_scale=k_scale,
            v_scale=v_scale,
            interpret=interpret,
        )
    if layout == PAGES_INTERLEAVED:  # off TPU, or a step without query blocks: costs a copy of the layer's pages
        k_cache, v_cache = split_pages(k_cache)
    return chunked_attention(
        q, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale
    )


def decode_fuses(
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata[jax.Array],
    *,
    head_dim: int,
    window: int | None,
    softcap,
) -> bool:
    """Whether a step's norms, rope, K/V write and attention run as gpu_fused_decode's one kernel: a decode step
    on a GPU (or the kernels interpreted on CPU), caches HEADS_FIRST, shapes the kernel tiles, no
    window or soft-capping; float32 too (its dots are IEEE)."""
    backend = jax.default_backend()
    if backend == "cpu" and KERNELS_INTERPRETED_ON_CPU:
        backend = "gpu"
    if not (
        FUSED_DECODE
        and meta.decode
        and backend == "gpu"
        and layout_of(v_cache) == HEADS_FIRST
        and window is None
        and not softcap
    ):
        return False
    from ..kernels.gpu_fused_decode_attention import supported

    return supported(k_cache.shape[2], head_dim)


def cpu_fuses(qkv_dtype, k_cache: jax.Array, v_cache: jax.Array, *, head_dim: int) -> bool:
    """Whether a step's rope, K/V write and attention run as the native CPU kernel's one call
    (cpu_paged_attention.rope_write_attend): on a CPU where the native attention runs (float32 queries and pages,
    HEADS_FIRST), on one device."""
    return (
        cpu_paged_attention.FUSED
        and jax.default_backend() == "cpu"
        and not KERNELS_INTERPRETED_ON_CPU
        and layout_of(v_cache) == HEADS_FIRST
        and head_dim % 2 == 0
        and head_dim <= 512
        and model_parallel_size() == 1
        and cpu_paged_attention.supported(qkv_dtype, k_cache.dtype)
        and cpu_paged_attention.available()
    )


def fused_decode(
    qkv,
    cos,
    sin,
    k_cache,
    v_cache,
    meta: AttentionMetadata[jax.Array],
    *,
    scale: float,
    q_norm,
    k_norm,
    eps: float,
    one_plus: bool,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    lora: tuple[jax.Array, jax.Array, jax.Array] | None = None,
):
    """qkv [T, KVH, G + 2, D] straight from the QKV matmul; returns (out [T, KVH, G, D], k_cache, v_cache):
    gpu_fused_decode's kernel, where decode_fuses says so. Under tensor parallelism each device runs it on its own
    KV heads (shard_map), as write_and_attend does: the norms and rope are per head, the pages are the device's.
    k_scale, v_scale: an FP8 cache's (kv_quantization). lora: the rows' q/k/v adapter delta for the kernel to add
    (its fused_decode_attention argument; one device only)."""
    from ..kernels.gpu_fused_decode_attention import fused_decode_attention

    k_scale, v_scale = scales_for(k_cache.dtype, k_scale, v_scale)

    def local(qkv, cos, sin, k_cache, v_cache, meta, q_norm, k_norm):
        return fused_decode_attention(
            qkv,
            cos,
            sin,
            k_cache,
            v_cache,
            meta,
            scale=scale,
            q_norm=q_norm,
            k_norm=k_norm,
            eps=eps,
            one_plus=one_plus,
            k_scale=k_scale,
            v_scale=v_scale,
            interpret=jax.default_backend() != "gpu",
            lora=lora,
        )

    if lora is not None and model_parallel_size() != 1:
        raise ValueError("the fused decode kernel adds a LoRA delta on one device only")
    if model_parallel_size() == 1:
        return local(qkv, cos, sin, k_cache, v_cache, meta, q_norm, k_norm)
    heads, pages = P(None, MODEL_AXIS), P(MODEL_AXIS)
    # check_vma off: the Pallas kernel has no replication rules; the specs say what each output is
    return jax.shard_map(
        local,
        in_specs=(heads, P(), P(), pages, pages, P(), P(), P()),
        out_specs=(heads, pages, pages),
        check_vma=False,
    )(qkv, cos, sin, k_cache, v_cache, meta, q_norm, k_norm)


def write_and_attend(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: AttentionMetadata[jax.Array],
    *,
    page_size: int,
    scale: float,
    window: int | None,
    softcap,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """Writes the step's k, v [T, KVH, D] into one layer's pages, then attends q [T, KVH, G, D] over them; returns
    (out [T, KVH, G, D], k_cache, v_cache). The caches are HEADS_FIRST ([KVH, pages, page_size, D] each) or, on
    TPU, PAGES_INTERLEAVED (k_cache [pages, page_size, 2 * KVH, D], v_cache an empty placeholder). Under tensor
    parallelism the caches are sharded by KV head and each device does both for its own KV heads (shard_map):
    attention never mixes heads, so no device reads another's pages, and every kernel above runs unchanged on its
    shard. k_scale, v_scale: the layer's FP8 scales (kv_quantization), used only when the cache is FP8."""
    layout = layout_of(v_cache)
    k_scale, v_scale = scales_for(k_cache.dtype, k_scale, v_scale)

    def local(q, k, v, k_cache, v_cache, meta):
        if layout == PAGES_INTERLEAVED:
            k_cache = write_kv_pages(k_cache, meta.slot_mapping, k, v, page_size, k_scale=k_scale, v_scale=v_scale)
        else:
            k_cache = write_kv(k_cache, meta.slot_mapping, k, page_size, k_scale)
            v_cache = write_kv(v_cache, meta.slot_mapping, v, page_size, v_scale)
        out = attend(
            q, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale
        )
        return out, k_cache, v_cache

    if model_parallel_size() == 1:
        return local(q, k, v, k_cache, v_cache, meta)
    heads = P(None, MODEL_AXIS)
    k_spec, v_spec = (P(None, None, MODEL_AXIS), P()) if layout == PAGES_INTERLEAVED else (P(MODEL_AXIS),) * 2
    # check_vma off: the Pallas kernels inside have no replication rules; the specs say what each output is
    return jax.shard_map(
        local, in_specs=(heads, heads, heads, k_spec, v_spec, P()), out_specs=(heads, k_spec, v_spec), check_vma=False
    )(q, k, v, k_cache, v_cache, meta)


__all__ = [
    "write_and_attend",
    "cpu_fuses",
    "decode_fuses",
    "fused_decode",
    "INVALID_SLOT",
    "AttentionMetadata",
    "query_blocks",
    "attend",
    "choose_kernel",
    "chunked_attention",
    "kv_layout",
    "paged_attention",
    "write_kv",
    "is_fp8",
    "HEADS_FIRST",
    "PAGES_INTERLEAVED",
]
