"""Ragged paged attention on NVIDIA GPUs: one Pallas (Triton) kernel for steps that mix prefill chunks and decode
tokens, reading every sequence's cached context in place.

The step's tokens are cut into query blocks (consecutive tokens of one sequence, built on the host by the batch
builder). A program takes one block and one kv head with all its query heads (QUERY_ROWS rows of (token, head)),
streams that sequence's pages from the cache once with an online softmax, and stops at the block's last causal
key; a sliding window also skips the pages before it. A decode token is a block of one token: its program reads
the context once for all its query heads, as a decode kernel does. Nothing is gathered (the reference reads
max_model_len keys for every token). float32 runs its dots in IEEE float32 (no TF32), so golden parity holds.
Pages of another dtype than the queries' (FP8, or bfloat16 under a float32 model) are upcast right after the
load; an FP8 cache's scales (kv_quantization) are folded into the logits' scale and the output."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..attention.kv_quantization import load
from ..attention.metadata import AttentionMetadata, padded_group, query_block_tokens

MAX_BLOCK_K = 128  # keys per inner iteration
TILE_BYTES = 32 * 1024  # per K or V tile: with double buffering, four of them stay within Hopper's shared memory
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so a row that sees nothing yet cannot make NaN


def tile_pages(head_dim: int, page_size: int, itemsize: int) -> int:
    """Pages per inner iteration: as many keys as fit a TILE_BYTES tile, up to MAX_BLOCK_K."""
    keys = min(MAX_BLOCK_K, TILE_BYTES // (head_dim * itemsize))
    return max(1, keys // page_size)


def supported(head_dim: int, page_size: int, itemsize: int = 2) -> bool:
    """Triton tiles need power-of-two sides of at least 16."""
    block_k = page_size * tile_pages(head_dim, page_size, itemsize)
    return all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, block_k))


def _kernel(
    blocks_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    _,
    o_ref,
    *,
    scale: float,
    window: int | None,
    softcap: float | None,
    page_size: int,
    pages_per_block: int,
    query_block: int,
    v_scale: float,
):
    b = pl.program_id(0)
    start, num, row, first_pos = blocks_ref[b, 0], blocks_ref[b, 1], blocks_ref[b, 2], blocks_ref[b, 3]
    block_k = page_size * pages_per_block
    G, D = q_ref.shape[-2:]
    rows = query_block * G  # row i is token i // G, query head i % G
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    @pl.when(num > 0)
    def _attend():
        q = q_ref[pl.ds(start, query_block), :, :].reshape(rows, D)
        q_pos = first_pos + jnp.arange(rows) // G
        end = first_pos + num  # keys 0 .. end-1 exist for this block's last token
        lo = 0 if window is None else jnp.maximum(first_pos - window + 1, 0) // block_k
        hi = pl.cdiv(end, block_k)

        def body(i, carry):
            o, m, l = carry
            pages = tables_ref[row, pl.ds(i * pages_per_block, pages_per_block)]
            k = load(k_ref[pages], q.dtype).reshape(block_k, D)  # FP8 pages: half the bytes loaded, upcast here
            v = load(v_ref[pages], q.dtype).reshape(block_k, D)
            s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [rows, BK] f32
            if softcap:
                s = jnp.tanh(s / softcap) * softcap
            k_pos = i * block_k + jnp.arange(block_k)
            visible = k_pos[None, :] <= q_pos[:, None]
            if window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - window
            s = jnp.where(visible, s, MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            l = l * correction + p.sum(axis=-1)
            o = o * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
            return o, m_new, l

        init = (
            jnp.zeros((rows, D), jnp.float32),
            jnp.full((rows,), MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )
        o, _, l = jax.lax.fori_loop(lo, hi, body, init)
        o = o * v_scale if v_scale != 1.0 else o
        out = (o / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype).reshape(query_block, G, D)
        tokens = jnp.arange(query_block) < num
        plgpu.store(o_ref.at[pl.ds(start, query_block), :, :], out, mask=tokens[:, None, None])


def decode_query_blocks(meta: AttentionMetadata[jax.Array]) -> jax.Array:
    """Query blocks of a decode batch (row r is token r), built on the device for multi-step decoding."""
    S = meta.positions.shape[0]
    rows = jnp.arange(S, dtype=jnp.int32)
    return jnp.stack([rows, (meta.seq_lens > 0).astype(jnp.int32), rows, meta.positions], axis=1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "window",
        "softcap",
        "k_scale",
        "v_scale",
        "interpret",
        "num_warps",
        "num_stages",
        "pages_per_block",
    ),
)
def ragged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata[jax.Array],
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
    pages_per_block: int | None = None,
) -> jax.Array:
    """q[T, KVH, G, D]; caches [KVH, pages, page_size, D] of one layer, already holding this step's K/V, of any
    dtype (k_scale, v_scale: an FP8 cache's scales). num_warps, num_stages, pages_per_block (None: a TILE_BYTES
    tile): Triton's tuning, for benchmarks/attention_kernels.py's sweep."""
    T, KVH, G, D = q.shape
    page_size = k_cache.shape[2]
    blocks = meta.query_blocks if meta.query_blocks is not None else decode_query_blocks(meta)
    query_block = query_block_tokens(G)
    tables = meta.block_tables
    ppb = pages_per_block or tile_pages(D, page_size, q.dtype.itemsize)
    pad = -tables.shape[1] % ppb
    if pad:  # the last iteration reads a whole block of table entries; the extra keys are masked
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    # query_block tokens of slack after the last one (a block's load and store never leave the array), and the
    # group of query heads padded to a power of two
    Gp = padded_group(G)
    q_padded = jnp.pad(q, ((0, query_block), (0, 0), (0, Gp - G), (0, 0)))
    out = jnp.zeros_like(q_padded)  # tokens no block covers (padding) read as zeros
    kernel = functools.partial(
        _kernel,
        scale=scale * k_scale,
        v_scale=v_scale,
        window=window,
        softcap=softcap,
        page_size=page_size,
        pages_per_block=ppb,
        query_block=query_block,
    )
    whole = lambda *shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))  # noqa: E731
    per_kv_head = pl.BlockSpec((T + query_block, None, Gp, D), lambda b, h: (0, h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(blocks.shape[0], KVH),
        in_specs=[
            whole(*blocks.shape),
            whole(*tables.shape),
            per_kv_head,
            pl.BlockSpec((None, k_cache.shape[1], page_size, D), lambda b, h: (h, 0, 0, 0)),
            pl.BlockSpec((None, v_cache.shape[1], page_size, D), lambda b, h: (h, 0, 0, 0)),
            per_kv_head,
        ],
        out_specs=per_kv_head,
        out_shape=jax.ShapeDtypeStruct(q_padded.shape, q.dtype),
        input_output_aliases={5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(blocks, tables, q_padded, k_cache, v_cache, out)
    return out[:T, :, :G]
