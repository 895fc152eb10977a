"""Ragged paged attention on TPUs: JAX's Pallas kernel (jax.experimental.pallas.ops.tpu.ragged_paged_attention),
with our step metadata mapped onto its arguments and the KV cache kept in the layout it reads.

The kernel reads one array per layer, `kv_pages [pages, page_size, 2 * kv_heads, head_dim]`, with K and V
interleaved on the head axis (K of head h at 2h, its V at 2h + 1), so one DMA brings a page's keys and values
together. On TPU the cache is allocated in that layout (`PAGES_INTERLEAVED`, see `kv_layout`) and this step's
K/V are scattered straight into it: nothing is transposed per step. The other backends keep `HEADS_FIRST`,
`[kv_heads, pages, page_size, head_dim]` for K and for V, which the reference and the GPU kernels read.

Its queries are the step's tokens grouped by sequence (`cu_q_lens`), each sequence's tokens being the last of
its `kv_lens` cached ones: exactly the batch builder's rows (row r's chunk ends at seq_lens[r])."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..attention.kv_quantization import is_fp8, store
from ..attention.metadata import AttentionMetadata

HEADS_FIRST = "heads_first"  # K and V each [kv_heads, pages, page_size, head_dim]
PAGES_INTERLEAVED = "pages_interleaved"  # one [pages, page_size, 2 * kv_heads, head_dim], K/V alternating
LANES = 128  # the kernel keeps its softmax sums 128 lanes wide and broadcasts them over head_dim
MIN_TPU_VERSION = 4  # the kernel's block-size table raises below v4
INTERPRETED_BLOCKS = (4, 16)  # (pages, queries) per block where no TPU is there to look its sizes up for


def tpu_version() -> int:
    """This host's TPU generation (-1 without a TPU), as the kernel's block-size table reads it."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes import get_tpu_version

    return get_tpu_version()


def supported(kv_heads: int, head_dim: int, kv_dtype) -> bool:
    """The shapes the installed kernel accepts (kv_heads: those of one device under tensor parallelism).

    head_dim a multiple of 128 (its running max and sum are 128 lanes wide); K/V heads the kernel can tile
    (it raises on the others: with 2 * kv_heads / packing in 1, 2, 4, 8 or a multiple of 8)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

    if head_dim % LANES:
        return False
    try:
        get_min_heads_per_blk(kv_heads, 2 * kv_heads, kv_dtype, kv_dtype)  # query heads only change its tiling
    except ValueError:
        return False
    return True


def allocate_pages(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, sharding=None):
    """One layer's kv_pages. sharding: a NamedSharding over KV heads (its spec names the head axis once)."""
    if sharding is not None:
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, None, *sharding.spec))
    return jnp.zeros((num_pages, page_size, 2 * kv_heads, head_dim), dtype, device=sharding)


def write_kv_pages(
    kv_pages: jax.Array,
    slots: jax.Array,
    k: jax.Array,
    v: jax.Array,
    page_size: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:
    """k, v [T, KVH, D] into kv_pages at slots (page * page_size + offset), as the cache's dtype stores them (FP8:
    divided by their scales); INVALID_SLOT is dropped."""
    T, KVH, D = k.shape
    dtype = kv_pages.dtype
    kv = jnp.stack([store(k, dtype, k_scale), store(v, dtype, v_scale)], axis=2).reshape(T, 2 * KVH, D)  # K0 V0 K1 ..
    return kv_pages.at[slots // page_size, slots % page_size].set(kv, mode="drop")


def split_pages(kv_pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The HEADS_FIRST k_cache, v_cache of kv_pages: a copy of the whole layer, for paths without the kernel."""
    k = jnp.transpose(kv_pages[:, :, 0::2], (2, 0, 1, 3))
    v = jnp.transpose(kv_pages[:, :, 1::2], (2, 0, 1, 3))
    return k, v


def kernel_arguments(meta: AttentionMetadata[jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(kv_lens, page_indices, cu_q_lens, num_seqs) of the kernel for a step built by the batch builder (query
    blocks) or a decode step (token r is row r's). Rows without tokens this step get kv_len 0: nothing read."""
    S = meta.block_tables.shape[0]
    if meta.decode:
        q_lens = jnp.ones(S, jnp.int32)
    else:
        blocks = meta.query_blocks
        assert blocks is not None, "a step that is not all decodes carries its query blocks (batch.py)"
        q_lens = jnp.zeros(S, jnp.int32).at[blocks[:, 2]].add(blocks[:, 1])
    kv_lens = jnp.where(q_lens > 0, meta.seq_lens, 0).astype(jnp.int32)
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    return kv_lens, meta.block_tables.astype(jnp.int32), cu_q_lens, jnp.array([S], jnp.int32)


def ragged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    meta: AttentionMetadata[jax.Array],
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    interpret=None,
) -> jax.Array:
    """q [T, KVH, G, D] over kv_pages [pages, page_size, 2 * KVH, D]; returns [T, KVH, G, D], zeros for padding.

    k_scale, v_scale: an FP8 cache's (kv_quantization); the kernel takes FP8 pages with per-tensor scales itself
    (it upcasts K and V after the load and multiplies them by their scales).
    interpret: None compiles for the TPU; a pltpu.InterpretParams (or True, Pallas' generic interpreter) runs the
    kernel on CPU."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    T, KVH, G, D = q.shape
    kv_lens, page_indices, cu_q_lens, num_seqs = kernel_arguments(meta)
    scales = dict(k_scale=float(k_scale), v_scale=float(v_scale)) if is_fp8(kv_pages.dtype) else {}
    blocks = {}
    if interpret is not None:
        pages, queries = INTERPRETED_BLOCKS
        blocks = dict(num_kv_pages_per_block=min(pages, page_indices.shape[1]), num_queries_per_block=min(queries, T))
    run = lambda: ragged_paged_attention(  # noqa: E731
        q.reshape(T, KVH * G, D),
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=scale,
        sliding_window=window,
        soft_cap=softcap or None,
        **scales,
        **blocks,
    )
    if interpret is None:
        out = run()
    else:
        with pltpu.force_tpu_interpret_mode(interpret):
            out = run()
    # the kernel leaves padding tokens' rows (past the last sequence, or of a row with nothing cached) unwritten
    real = (jnp.arange(T) < cu_q_lens[-1]) & (kv_lens[meta.token_seq] > 0)
    return jnp.where(real[:, None, None], out, 0).reshape(T, KVH, G, D)
