"""Paged attention: the plain-XLA reference defines correctness; faster kernels are chosen by backend."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..parallel.mesh import MODEL_AXIS, model_parallel_size
from .chunked import chunked_attention
from .metadata import INVALID_SLOT, AttentionMetadata, query_blocks
from .reference import paged_attention, write_kv


# Tests set this to run the GPU kernels interpreted on CPU, so CI covers their wiring into the engine too.
KERNELS_INTERPRETED_ON_CPU = False


def attend(q, k_cache, v_cache, meta: AttentionMetadata, *, scale: float, window: int | None, softcap):
    """Chooses the kernel at trace time. On GPUs: bf16 decode batches of layers without a window or soft-capping
    take JAX's Pallas decode kernel (it splits long contexts across blocks), every other step our ragged Pallas
    kernel (prefill chunks with their cached context, mixed with decode tokens; float32 decode too, since JAX's
    kernel multiplies in TF32). Elsewhere, and for head sizes Triton cannot tile, the reference's result computed
    over the step's real context only (chunked_attention), not over max_model_len keys."""
    interpret = jax.default_backend() != "gpu"
    if not interpret or KERNELS_INTERPRETED_ON_CPU:
        from .gpu_decode import decode_attention
        from .gpu_decode import supported as decode_supported
        from .gpu_ragged import ragged_attention, supported

        if meta.decode and window is None and not softcap and q.dtype != jnp.float32 and decode_supported(
                q.shape[0], q.shape[1], meta.block_tables.shape[1], k_cache.shape[2]):
            return decode_attention(q, k_cache, v_cache, meta, scale=scale, interpret=interpret)
        if (meta.decode or meta.query_blocks is not None) and supported(q.shape[-1], k_cache.shape[2], q.dtype.itemsize):
            return ragged_attention(q, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap or None,
                                    interpret=interpret)
    return chunked_attention(q, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap)


def write_and_attend(q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, page_size: int, scale: float,
                     window: int | None, softcap):
    """Writes the step's k, v [T, KVH, D] into one layer's pages, then attends q [T, KVH, G, D] over them; returns
    (out [T, KVH, G, D], k_cache, v_cache). Under tensor parallelism the caches are sharded by KV head and each
    device does both for its own KV heads (shard_map): attention never mixes heads, so no device reads another's
    pages, and every kernel above (reference, chunked, the GPU Pallas ones) runs unchanged on its shard."""

    def local(q, k, v, k_cache, v_cache, meta):
        k_cache = write_kv(k_cache, meta.slot_mapping, k, page_size)
        v_cache = write_kv(v_cache, meta.slot_mapping, v, page_size)
        out = attend(q, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap)
        return out, k_cache, v_cache

    if model_parallel_size() == 1:
        return local(q, k, v, k_cache, v_cache, meta)
    heads, cache = P(None, MODEL_AXIS), P(MODEL_AXIS)
    # check_vma off: the Pallas kernels inside have no replication rules; the specs say what each output is
    return jax.shard_map(local, in_specs=(heads, heads, heads, cache, cache, P()), out_specs=(heads, cache, cache),
                         check_vma=False)(q, k, v, k_cache, v_cache, meta)


__all__ = ["write_and_attend", "INVALID_SLOT", "AttentionMetadata", "query_blocks", "attend", "chunked_attention", "paged_attention",
           "write_kv"]
