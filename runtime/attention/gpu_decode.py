"""Decode attention on NVIDIA GPUs: JAX's Pallas (Triton) paged-attention kernel, one query token per sequence.

It reads each sequence's pages in place (no gathered copy of the context) and splits long contexts across
thread blocks (flash-decoding). It has no sliding window and no softmax scale of its own: queries are
pre-scaled, and sliding-window models keep the reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pallas_paged_attention

from .metadata import AttentionMetadata

PAGES_PER_BLOCK = 8  # pages loaded per inner iteration of the kernel (128 keys with 16-token pages)
NUM_WARPS, NUM_STAGES = 8, 2  # JAX's defaults
ENOUGH_PROGRAMS = 1024  # with this many (sequence, kv head) pairs the GPU is full without splitting contexts


def _layout(S: int, KVH: int, pages_per_seq: int) -> tuple[int, int]:
    """(k_splits, pages_per_block): split long contexts across blocks (flash-decoding) only when the batch alone
    cannot fill the GPU; Triton tiles have power-of-two sides, so a short context's block is rounded up."""
    k_splits = 1 if S * KVH >= ENOUGH_PROGRAMS else max(1, min(8, pages_per_seq // PAGES_PER_BLOCK))
    return k_splits, min(PAGES_PER_BLOCK, 1 << (-(-pages_per_seq // k_splits) - 1).bit_length())


def supported(S: int, KVH: int, pages_per_seq: int, page_size: int) -> bool:
    block_k = page_size * _layout(S, KVH, pages_per_seq)[1]
    return block_k >= 16 and block_k & (block_k - 1) == 0


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata, *,
                     scale: float, interpret: bool = False, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                     pages_per_block: int | None = None) -> jax.Array:
    """q[S, KVH, G, D] (row r is sequence r's only token); caches [KVH, pages, page_size, D] of one layer.
    num_warps, num_stages, pages_per_block: Triton's tuning (benchmarks/attention_kernels.py --sweep times them)."""
    S, KVH, G, D = q.shape
    tables = meta.block_tables
    k_splits, per_block = _layout(S, KVH, tables.shape[1])
    pages_per_block = pages_per_block or per_block
    pad = -tables.shape[1] % (k_splits * pages_per_block)
    if pad:  # padded entries point at page 0 and lie past every length, so they are masked
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    lengths = jnp.where(meta.seq_lens > 0, meta.positions + 1, 0)  # keys 0..position; padding rows see none
    out = pallas_paged_attention((q * scale).reshape(S, KVH * G, D), k_cache, v_cache, tables, lengths,
                                 block_h=max(16, G), pages_per_compute_block=pages_per_block, k_splits=k_splits,
                                 num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return out.reshape(S, KVH, G, D)
