"""Decode attention on NVIDIA GPUs: JAX's Pallas (Triton) paged-attention kernel, one query token per sequence.

It reads each sequence's pages in place (no gathered copy of the context) and splits long contexts across
thread blocks (flash-decoding). It has no sliding window and no softmax scale of its own: queries are
pre-scaled, and sliding-window models keep the reference.

FP8 pages: the kernel upcasts quantized K and V after the load only when it is given per-slot scale arrays
([kv_heads, pages, page_size]), which it multiplies into the logits and probabilities. Our scales are per tensor
(kv_quantization), so it is given one array of ones, shared by K and V (a bf16 fill of kv_heads x pages x
page_size per step, which XLA shares between layers; the kernel reads 2 bytes of it per key beside head_dim
bytes of FP8), and the scales are folded into the query and the output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pallas_paged_attention

from ..attention.kv_quantization import is_fp8
from ..attention.metadata import AttentionMetadata

SPLIT_PAGES = 8  # a long context is split into parts of at least this many pages (flash-decoding)
ENOUGH_PROGRAMS = 1024  # with this many (sequence, kv head) pairs the GPU is full without splitting contexts
# Triton's tuning (num_warps, num_stages, pages loaded per inner iteration), from `python
# benchmarks/attention_kernels.py --sweep` on an H100 (2026-11-25, bf16, 16-token pages; JAX's defaults are 8, 2, 8):
# 256 rows of 256-511 tokens, head_dim 64 (Llama-3.2-1B): 0.304 -> 0.209 ms a layer; head_dim 128 (Qwen3-0.6B):
# 0.395 -> 0.322; one row of 384 (split): 0.087 -> 0.065. Short blocks of 4 pages won everywhere.
FULL_BATCH_TUNING = {64: (2, 2, 4), 128: (8, 1, 4)}  # by head_dim; others take 128's
SPLIT_TUNING = (4, 1, 4)


def _layout(S: int, KVH: int, pages_per_seq: int, D: int) -> tuple[int, int, int, int]:
    """(k_splits, pages_per_block, num_warps, num_stages): split long contexts across blocks (flash-decoding) only
    when the batch alone cannot fill the GPU; Triton tiles have power-of-two sides, so a short context's block is
    rounded up."""
    full = S * KVH >= ENOUGH_PROGRAMS
    k_splits = 1 if full else max(1, min(8, pages_per_seq // SPLIT_PAGES))
    warps, stages, per_block = FULL_BATCH_TUNING.get(D, FULL_BATCH_TUNING[128]) if full else SPLIT_TUNING
    return k_splits, min(per_block, 1 << (-(-pages_per_seq // k_splits) - 1).bit_length()), warps, stages


def supported(S: int, KVH: int, pages_per_seq: int, page_size: int, head_dim: int) -> bool:
    block_k = page_size * _layout(S, KVH, pages_per_seq, head_dim)[1]
    return block_k >= 16 and block_k & (block_k - 1) == 0


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata[jax.Array],
    *,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pages_per_block: int | None = None,
) -> jax.Array:
    """q[S, KVH, G, D] (row r is sequence r's only token); caches [KVH, pages, page_size, D] of one layer, of q's
    dtype or FP8 (k_scale, v_scale: its scales). num_warps, num_stages, pages_per_block: Triton's tuning, else
    _layout's (attention_kernels.py --sweep)."""
    S, KVH, G, D = q.shape
    tables = meta.block_tables
    k_splits, per_block, warps, stages = _layout(S, KVH, tables.shape[1], D)
    pages_per_block, num_warps, num_stages = pages_per_block or per_block, num_warps or warps, num_stages or stages
    pad = -tables.shape[1] % (k_splits * pages_per_block)
    if pad:  # padded entries point at page 0 and lie past every length, so they are masked
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    lengths = jnp.where(meta.seq_lens > 0, meta.positions + 1, 0)  # keys 0..position; padding rows see none
    scales = {}
    if is_fp8(k_cache.dtype):  # the kernel upcasts FP8 pages only beside per-slot scales: ones, ours folded in
        unit = jnp.ones(k_cache.shape[:3], q.dtype)
        scales = dict(k_scales_pages=unit, v_scales_pages=unit)
    out = pallas_paged_attention(
        (q * (scale * k_scale)).reshape(S, KVH * G, D),
        k_cache,
        v_cache,
        tables,
        lengths,
        **scales,
        block_h=max(16, G),
        pages_per_compute_block=pages_per_block,
        k_splits=k_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    if v_scale != 1.0:
        out = (out.astype(jnp.float32) * v_scale).astype(q.dtype)
    return out.reshape(S, KVH, G, D)
