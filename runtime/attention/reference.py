"""Paged attention in plain XLA: gather each token's pages, mask, softmax. The definition of correct."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .kv_quantization import load, store
from .metadata import AttentionMetadata


def write_kv(cache: jax.Array, slots: jax.Array, values: jax.Array, page_size: int, scale: float = 1.0) -> jax.Array:
    """cache[KVH, pages, page_size, D] (one layer); values[T, KVH, D] go to slots (page * page_size + offset), as
    the cache's dtype stores them (FP8: divided by scale, kv_quantization.store).

    INVALID_SLOT lands past the last page and is dropped."""
    return cache.at[:, slots // page_size, slots % page_size].set(
        store(jnp.swapaxes(values, 0, 1), cache.dtype, scale), mode="drop"
    )


def paged_attention(
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
    """Causal attention of each token over its own sequence's cached keys (already including this step's)."""
    pages = meta.block_tables[meta.token_seq]  # [T, P]
    T, P = pages.shape
    k = load(k_cache[:, pages], q.dtype).reshape(k_cache.shape[0], T, -1, k_cache.shape[-1])  # [KVH, T, C, D]
    v = load(v_cache[:, pages], q.dtype).reshape(k.shape)
    scores = jnp.einsum("tkgd,ktcd->tkgc", q, k, preferred_element_type=jnp.float32) * (scale * k_scale)
    if softcap:
        scores = jnp.tanh(scores / softcap) * softcap
    key_pos = jnp.arange(k.shape[2])[None, :]
    query_pos = meta.positions[:, None]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgc,ktcd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (out * v_scale if v_scale != 1.0 else out).astype(q.dtype)
