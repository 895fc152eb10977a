"""Decode attention on NVIDIA GPUs with the step's own work folded in: one Pallas (Triton) kernel a layer.

At one token a sequence, what lies between a layer's QKV matmul and its output projection is mostly small kernels:
the q/k RMSNorms (Qwen3), rope of q and of k, the v slice, the K and V writes into their pages, ~7.8 us of a
Llama-3.2-1B layer's ~70 at one stream (benchmarks/RESULTS.md, "One stream, kernel by kernel"). Here a program
per (sequence, kv head, context split) loads its query heads and its key straight from the QKV matmul's output,
norms and rotates them in registers (rotate-half as a dot with a signed permutation: exact), attends over the
cached context (flash-decoding: splits share the pages the sequence has filled, combined after), adds the step's
own key and value from registers, and the first split writes them into their page slot, so no program reads a
slot another writes.
Float32 takes IEEE dots (JAX's decode kernel multiplies in TF32), so golden float32 parity holds through it.
FP8 pages (kv_quantization): loads are upcast in registers, the scales folded into the logits' scale and the
output, and the step's own key and value are rounded to what the page stores before they are attended, as the
reference reads them back."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..attention.kv_quantization import load, store
from ..attention.metadata import AttentionMetadata

# Triton's tuning (num_warps, num_stages, pages per inner iteration), swept on an H200 (2026-11-26, bf16, 16-token
# pages, context 384, whole decode steps: `CAPSTAN_FUSED_DECODE_TUNING=w,s,p python3 benchmarks/decode_profile.py
# --rows R --context 384 --quick`): 256 rows, Llama-3.2-1B (head_dim 64) 2,1,4 2.082 ms a step against gpu_decode's
# 2,2,4 2.325; Qwen3-0.6B (128) 4,1,4 3.217 against 8,1,4 3.434; one row of Llama-3.2-1B 1.11-1.24 for all six tried
FULL_BATCH_TUNING = {64: (2, 1, 4), 128: (4, 1, 4)}  # by head_dim; others take 128's
SPLIT_TUNING = (4, 1, 4)
ENOUGH_PROGRAMS = 1024  # (sequence, kv head) pairs that fill the GPU alone; fewer split their contexts too
MAX_SPLITS = 16
# "num_warps,num_stages,pages_per_block[,k_splits]" for every call instead: the sweep's knob
TUNING = os.environ.get("CAPSTAN_FUSED_DECODE_TUNING")
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # a finite -inf: fully masked blocks never meet exp(inf - inf)


def supported(page_size: int, head_dim: int) -> bool:
    """Shapes Triton can tile: power-of-two head_dim (at least a dot's 16) and blocks of at least 16 keys."""
    pages = min(p for *_, p in (*FULL_BATCH_TUNING.values(), SPLIT_TUNING))
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return head_dim >= 16 and pow2(head_dim) and pow2(page_size) and page_size * pages >= 16


def _kernel(
    qkv_ref,
    cos_ref,
    sin_ref,
    q_norm_ref,
    k_norm_ref,
    tables_ref,
    row_ref,
    lora_h_ref,
    lora_b_ref,
    k_ref,
    v_ref,
    o_ref,
    *rest,
    groups: int,
    pages_per_block: int,
    scale: float,
    k_scale: float,
    v_scale: float,
    eps: float,
    one_plus: bool,
    normalize: bool,
    precision,
):
    l_ref, m_ref, k_out_ref, v_out_ref = (None, None, *rest) if normalize else rest
    split, splits = pl.program_id(2), pl.num_programs(2)
    block_h, D = o_ref.shape
    pages, page_size = k_ref.shape[0], k_ref.shape[1]
    block_k = pages_per_block * page_size
    dtype = qkv_ref.dtype
    length, slot = row_ref[0], row_ref[1]  # length 0: a padding row
    pos = length - 1  # this token's position: the cache holds the sequence's positions before it
    rows = jax.lax.broadcasted_iota(jnp.int32, (block_h, D), 0)
    # the query heads, then the key on every row after them (its copies' results are never read)
    heads = jnp.minimum(jnp.arange(block_h), groups)
    x = qkv_ref[heads].astype(jnp.float32)  # [block_h, D]
    v_row = qkv_ref[groups + 1]  # [D]
    if lora_h_ref is not None:  # the row's adapter delta on q, k and v: its rank space through its slot's B
        adapter = row_ref[2]
        dx = jnp.zeros((block_h, D), jnp.float32)
        dv = jnp.zeros((D,), jnp.float32)
        for r in range(lora_h_ref.shape[0]):  # unrolled: every load issued at once
            weight = lora_h_ref[r]
            dx += weight * lora_b_ref[adapter, r, heads].astype(jnp.float32)
            dv += weight * lora_b_ref[adapter, r, groups + 1].astype(jnp.float32)
        # as the layers add it: the delta rounded to the model's dtype, then the sum rounded
        x = (x + dx.astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
        v_row = (v_row.astype(jnp.float32) + dv.astype(dtype).astype(jnp.float32)).astype(dtype)
    if q_norm_ref is not None:  # RMSNorm over each head (Qwen3, Gemma-3), in float32 as layers.rms_norm
        w = jnp.where(rows < groups, q_norm_ref[...][None, :], k_norm_ref[...][None, :]).astype(jnp.float32)
        normed = x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / D + eps)
        x = (normed * (1.0 + w) if one_plus else w * normed.astype(dtype).astype(jnp.float32)).astype(dtype)
        x = x.astype(jnp.float32)
    # rope, rotate-half: x * cos + rotate_half(x) * sin, where rotate_half(x) = x @ turn (entries 0 and +-1)
    half = D // 2
    i = jax.lax.broadcasted_iota(jnp.int32, (D, D), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (D, D), 1)
    turn = jnp.where((j < half) & (i == j + half), -1.0, jnp.where((j >= half) & (i == j - half), 1.0, 0.0))
    rotated = plgpu.dot(x.astype(dtype), turn.astype(dtype), precision=precision)
    cos = cos_ref[...].astype(dtype).astype(jnp.float32)[None, :]
    sin = sin_ref[...].astype(dtype).astype(jnp.float32)[None, :]
    q = (x * cos + rotated * sin).astype(dtype)  # [block_h, D]: rotated query heads, then the rotated key
    # the key row and the value as their pages store them (FP8: divided by their scales)
    k_new = store(jnp.sum(jnp.where(rows == groups, q.astype(jnp.float32), 0.0), axis=0), k_ref.dtype, k_scale)
    v_new = store(v_row, v_ref.dtype, v_scale)  # [D]
    scale = scale * k_scale  # logits of stored keys

    def block(b, carry):
        o, m, l = carry
        first_page = pl.multiple_of(start + b * pages_per_block, pages_per_block)
        ids = tables_ref[pl.ds(first_page, pages_per_block)]
        k = load(k_ref[ids], dtype).reshape(block_k, D)  # FP8 pages: half the bytes loaded, upcast here
        v = load(v_ref[ids], dtype).reshape(block_k, D)
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [block_h, block_k]
        first = first_page * page_size
        s = jnp.where(first + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) < pos, s, MASKED)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(s - m_next[:, None])
        o = o * correction[:, None] + plgpu.dot(p.astype(dtype), v, precision=precision)
        return o, m_next, l * correction + jnp.sum(p, axis=1)

    # the splits share the pages this sequence has filled (not the table's width, which is max_model_len's), in
    # whole blocks: every block holds at least one key before pos
    filled = pl.cdiv(jnp.maximum(pos, 0), page_size)
    per_split = pl.cdiv(pl.cdiv(filled, splits), pages_per_block) * pages_per_block
    start = split * per_split
    blocks = pl.cdiv(jnp.maximum(jnp.minimum(filled, start + per_split) - start, 0), pages_per_block)
    init = (
        jnp.zeros((block_h, D), jnp.float32),
        jnp.full((block_h,), MASKED, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    o, m, l = jax.lax.fori_loop(0, blocks, block, init)
    # the step's own key and value, from registers, counted once: by the first split
    own = (split == 0) & (length > 0)
    s_own = jnp.sum(q.astype(jnp.float32) * load(k_new, jnp.float32)[None, :], axis=1) * scale
    m_next = jnp.where(own, jnp.maximum(m, s_own), m)
    correction = jnp.exp(m - m_next)
    p_own = jnp.where(own, jnp.exp(s_own - m_next), 0.0)
    o = o * correction[:, None] + p_own[:, None] * load(v_new, jnp.float32)[None, :]
    o = o * v_scale if v_scale != 1.0 else o  # stored values to values
    l = l * correction + p_own
    if normalize:
        o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        o_ref[...] = o
        l_ref[...] = l
        m_ref[...] = m_next
    write = (split == 0) & (slot >= 0) & (slot < pages * page_size)  # INVALID_SLOT lies past the last page

    @pl.when(write)
    def _():
        k_out_ref[slot // page_size, slot % page_size, :] = k_new
        v_out_ref[slot // page_size, slot % page_size, :] = v_new


def fused_decode_attention(
    qkv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata[jax.Array],
    *,
    scale: float,
    q_norm: jax.Array | None = None,
    k_norm: jax.Array | None = None,
    eps: float = 0.0,
    one_plus: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pages_per_block: int | None = None,
    k_splits: int | None = None,
    lora: tuple[jax.Array, jax.Array, jax.Array] | None = None,
):
    """qkv[S, KVH, G + 2, D]: row r's query heads, key and value before norms and rope (row r is sequence r's only
    token, at meta.positions[r]); cos, sin [S, D] float32; caches [KVH, pages, page_size, D] of one layer;
    q_norm, k_norm [D] or None; k_scale, v_scale: an FP8 cache's scales (kv_quantization). Returns (out [S, KVH, G, D], k_cache, v_cache with the step's K/V written at
    meta.slot_mapping; INVALID_SLOT writes nothing). The tuning arguments default to the tables above.
    lora: (h [S, J] float32, b [slots, J, KVH, G + 2, D], slot [S]): qkv gets h @ b[slot] added first (models/lora.py's
    q/k/v delta: the row's own rank space, zeros for a base row, through its slot's B), so no kernel of its own."""
    S, KVH, rows, D = qkv.shape
    G = rows - 2
    tables = meta.block_tables
    k_splits = k_splits or max(1, min(MAX_SPLITS, ENOUGH_PROGRAMS // (S * KVH)))  # fill the GPU
    warps, stages, most = SPLIT_TUNING if k_splits > 1 else FULL_BATCH_TUNING.get(D, FULL_BATCH_TUNING[128])
    if TUNING:
        warps, stages, most, *rest = (int(t) for t in TUNING.split(","))
        k_splits = rest[0] if rest else k_splits
    pages_per_block = pages_per_block or most  # pages a program loads at once
    pad = -tables.shape[1] % pages_per_block
    if pad:  # padded entries point at page 0 and lie past every length, so they are masked
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    row_parts = [jnp.where(meta.seq_lens > 0, meta.positions + 1, 0), meta.slot_mapping]
    lora_h = lora_b = None
    if lora is not None:
        lora_h, lora_b, adapter = lora
        row_parts += [adapter.astype(jnp.int32), jnp.zeros_like(adapter, jnp.int32)]  # (four: a power of two)
    row = jnp.stack(row_parts, axis=1)
    block_h = max(16, 1 << G.bit_length())  # G query rows and the key's, a power of two, at least a dot's 16
    normalize = k_splits == 1
    precision = jax.lax.Precision.HIGHEST if qkv.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel,
        groups=G,
        pages_per_block=pages_per_block,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        eps=eps,
        one_plus=one_plus,
        normalize=normalize,
        precision=precision,
    )
    cache_spec = pl.BlockSpec((None, *k_cache.shape[1:]), lambda s, h, k: (h, 0, 0, 0))
    norm_spec = pl.BlockSpec((D,), lambda s, h, k: (0,))
    out_spec = pl.BlockSpec((None, None, None, block_h, D), lambda s, h, k: (k, s, h, 0, 0))
    stat_spec = pl.BlockSpec((None, None, None, block_h), lambda s, h, k: (k, s, h, 0))
    stats = [] if normalize else [stat_spec, stat_spec]
    stat_shapes = [] if normalize else [jax.ShapeDtypeStruct((k_splits, S, KVH, block_h), jnp.float32)] * 2
    inputs = [qkv, cos, sin, q_norm, k_norm, tables, row, lora_h, lora_b, k_cache, v_cache]
    present = [a for a in inputs if a is not None]  # the aliases count the inputs pallas_call is given
    first_out_cache = 1 + len(stats)
    aliases = {len(present) - 2: first_out_cache, len(present) - 1: first_out_cache + 1}  # the caches, in place
    outs = pl.pallas_call(
        kernel,
        grid=(S, KVH, k_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, D), lambda s, h, k: (s, h, 0, 0)),
            pl.BlockSpec((None, D), lambda s, h, k: (s, 0)),
            pl.BlockSpec((None, D), lambda s, h, k: (s, 0)),
            None if q_norm is None else norm_spec,
            None if k_norm is None else norm_spec,
            pl.BlockSpec((None, tables.shape[1]), lambda s, h, k: (s, 0)),
            pl.BlockSpec((None, row.shape[1]), lambda s, h, k: (s, 0)),
            None if lora_h is None else pl.BlockSpec((None, lora_h.shape[1]), lambda s, h, k: (s, 0)),
            None
            if lora_b is None
            else pl.BlockSpec((*lora_b.shape[:2], None, *lora_b.shape[3:]), lambda s, h, k: (0, 0, h, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=[out_spec, *stats, cache_spec, cache_spec],
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, S, KVH, block_h, D), qkv.dtype if normalize else jnp.float32),
            *stat_shapes,
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or warps, num_stages=num_stages or stages),
        interpret=interpret,
        name=f"fused_decode_{block_h=}_{pages_per_block=}_{k_splits=}",
    )(*inputs)
    if normalize:
        o, k_cache, v_cache = outs
        return o[0, :, :, :G].astype(qkv.dtype), k_cache, v_cache
    o, l, m, k_cache, v_cache = outs
    o, l, m = o[:, :, :, :G], l[:, :, :, :G], m[:, :, :, :G]
    # flash-decoding's last round: the splits' partial softmaxes rescaled to their common maximum and summed
    top = m.max(axis=0)
    weight = jnp.exp(m - top[None])
    total = (l * weight).sum(axis=0)
    o = (o * weight[..., None]).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return o.astype(qkv.dtype), k_cache, v_cache
