"""Paged attention in plain XLA whose cost follows the real context, not max_model_len (CPU, TPU, fallbacks).

The reference gathers every token's whole block table (max_model_len keys), so it costs the same at 64 tokens
of context as at 4,000. Here the step's tokens are cut into QUERY_GROUPS groups of consecutive tokens, and each
group walks its tokens' block tables in chunks of KEYS_PER_CHUNK keys with an online softmax (flash
attention's), stopping after the chunk holding the group's last causal key. Both loop bounds are traced values,
so one compiled program serves every context length: no page-count buckets, no extra compiles at warm-up, and
multi-step decoding (whose context grows inside one dispatch) bounds each of its steps by that step's positions.
Groups make one long sequence cost its own context only: a lone stream among padding rows, or a prefill chunk,
whose early tokens stop early (causality)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .kv_quantization import load
from .metadata import AttentionMetadata

KEYS_PER_CHUNK = 128  # keys per inner iteration: on CPU its overhead is small next to 128 keys' work
QUERY_GROUPS = 8  # token groups per step, each with its own key bound (more: tighter bounds, more iterations)
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so a chunk a token cannot see makes no NaN


def chunked_attention(
    q: jax.Array,  # [T, KVH, G, D]
    k_cache: jax.Array,  # [KVH, pages, page_size, D] (one layer)
    v_cache: jax.Array,
    meta: AttentionMetadata[jax.Array],
    *,
    scale: float,
    window: jax.Array | int | None = None,  # keys within `window` positions of the query, itself included
    softcap: float | None = None,
    k_scale: float = 1.0,  # FP8 caches: what each stored key and value stands for (kv_quantization)
    v_scale: float = 1.0,
) -> jax.Array:
    """The reference's result (paged_attention), reading only the key chunks each group of tokens can see."""
    T, KVH, G, D = q.shape
    page_size = k_cache.shape[2]
    chunk_pages = max(1, KEYS_PER_CHUNK // page_size)
    chunk_keys = chunk_pages * page_size
    tables = meta.block_tables
    pad = -tables.shape[1] % chunk_pages
    if pad:  # the last chunk reads a whole chunk of table entries; keys past every position are masked
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    group = -(-T // QUERY_GROUPS)
    num_groups = -(-T // group)
    extra = num_groups * group - T  # padded tokens sit at position 0 of row 0: one chunk, then ignored
    positions = jnp.pad(meta.positions, (0, extra)).reshape(num_groups, group)
    token_pages = jnp.pad(tables[meta.token_seq], ((0, extra), (0, 0))).reshape(num_groups, group, -1)
    qs = jnp.pad(q, ((0, extra), (0, 0), (0, 0), (0, 0))).reshape(num_groups, group, KVH, G, D)
    hi = positions.max(axis=1) // chunk_keys + 1  # [groups]: chunks up to each group's last token's own key
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(positions.min(axis=1) - window + 1, 0) // chunk_keys

    def attend_group(g, out):
        q_g, pos, pages_g = qs[g], positions[g][:, None], token_pages[g]

        def chunk(i, carry):
            acc, m, l, _ = carry
            pages = jax.lax.dynamic_slice_in_dim(pages_g, i * chunk_pages, chunk_pages, axis=1)
            k = load(k_cache[:, pages], q.dtype).reshape(KVH, group, chunk_keys, D)  # FP8 upcast after the gather
            v = load(v_cache[:, pages], q.dtype).reshape(KVH, group, chunk_keys, D)
            s = jnp.einsum("tkgd,ktcd->tkgc", q_g, k, preferred_element_type=jnp.float32) * (scale * k_scale)
            if softcap:
                s = jnp.tanh(s / softcap) * softcap
            key_pos = i * chunk_keys + jnp.arange(chunk_keys)[None, :]
            visible = key_pos <= pos
            if window is not None:
                visible &= key_pos > pos - window
            visible = visible[:, None, None, :]
            s = jnp.where(visible, s, MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            correction = jnp.exp(m - m_new)
            p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
            l = l * correction + p.sum(axis=-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "tkgc,ktcd->tkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32
            )
            # normalised inside the loop and kept flat per token: a CPU matrix-vector loop reading the output (o_proj's)
            # would otherwise redo the division, and walk four axes' indices, for every output row (7x its time)
            scaled = acc * v_scale if v_scale != 1.0 else acc
            return acc, m_new, l, (scaled / jnp.maximum(l, 1e-30)[..., None]).astype(q.dtype).reshape(group, -1)

        init = (
            jnp.zeros((group, KVH, G, D), jnp.float32),
            jnp.full((group, KVH, G), MASKED, jnp.float32),
            jnp.zeros((group, KVH, G), jnp.float32),
            jnp.zeros((group, KVH * G * D), q.dtype),  # no key seen: zeros
        )
        return out.at[g].set(jax.lax.fori_loop(lo[g], hi[g], chunk, init)[3].reshape(group, KVH, G, D))

    out = jax.lax.fori_loop(0, num_groups, attend_group, jnp.zeros_like(qs))
    return out.reshape(num_groups * group, KVH, G, D)[:T]
