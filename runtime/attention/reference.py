"""Paged attention in plain XLA: gather each token's pages, mask, softmax. The definition of correct."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .metadata import AttentionMetadata


def write_kv(cache: jax.Array, layer: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """cache[L, slots_total, KVH, D]; values[T, KVH, D] written at cache[layer, slots]; INVALID_SLOT dropped."""
    return cache.at[layer, slots].set(values.astype(cache.dtype), mode="drop")


def paged_attention(
    q: jax.Array,  # [T, KVH, G, D]
    k_cache: jax.Array,  # [slots_total, KVH, D] (one layer)
    v_cache: jax.Array,  # [slots_total, KVH, D]
    meta: AttentionMetadata,
    *,
    page_size: int,
    scale: float,
    window: jax.Array | int | None = None,  # keys within `window` positions of the query, itself included
    softcap: float | None = None,
) -> jax.Array:
    """Causal attention of each token over its own sequence's cached keys (already including this step's)."""
    pages = meta.block_tables[meta.token_seq]  # [T, P]
    slots = (pages[:, :, None] * page_size + jnp.arange(page_size)[None, None, :]).reshape(pages.shape[0], -1)
    k = k_cache[slots]  # [T, C, KVH, D]
    v = v_cache[slots]
    scores = jnp.einsum("tkgd,tckd->tkgc", q, k, preferred_element_type=jnp.float32) * scale
    if softcap:
        scores = jnp.tanh(scores / softcap) * softcap
    key_pos = jnp.arange(slots.shape[1])[None, :]
    query_pos = meta.positions[:, None]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("tkgc,tckd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)
