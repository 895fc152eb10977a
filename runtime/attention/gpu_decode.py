"""Decode attention on NVIDIA GPUs: JAX's Pallas (Triton) paged-attention kernel, one query token per sequence.

It reads each sequence's pages in place (no gathered copy of the context) and splits long contexts across
thread blocks (flash-decoding). It has no sliding window and no softmax scale of its own: queries are
pre-scaled, and sliding-window models keep the reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pallas_paged_attention

from .metadata import AttentionMetadata

K_SPLITS = 8  # partitions of the page list reduced at the end; block tables are padded to a multiple


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata, *,
                     scale: float, interpret: bool = False) -> jax.Array:
    """q[S, KVH, G, D] (row r is sequence r's only token); caches [KVH, pages, page_size, D] of one layer."""
    S, KVH, G, D = q.shape
    tables = meta.block_tables
    pad = -tables.shape[1] % K_SPLITS
    if pad:
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    per_split = tables.shape[1] // K_SPLITS
    pages_per_block = next(b for b in (8, 4, 2, 1) if per_split % b == 0)
    lengths = jnp.where(meta.seq_lens > 0, meta.positions + 1, 0)  # keys 0..position; padding rows see none
    out = pallas_paged_attention((q * scale).reshape(S, KVH * G, D), k_cache, v_cache, tables, lengths,
                                 block_h=max(16, G), pages_per_compute_block=pages_per_block, k_splits=K_SPLITS,
                                 interpret=interpret)
    return out.reshape(S, KVH, G, D)
