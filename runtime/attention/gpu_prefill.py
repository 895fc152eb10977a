"""Prefill attention on NVIDIA GPUs for steps whose every chunk starts a sequence (no cached context to read).

Then a token attends only to earlier tokens of its own chunk in this step, which is flash attention over the
flat batch with one segment per sequence: JAX's Pallas (Triton) `mha` kernel with causal masking and segment
ids, K/V heads repeated for grouped queries. Steps with cached context keep the paged reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.attention import mha

from .metadata import INVALID_SLOT, AttentionMetadata

BLOCK = 128  # the kernel's default query and key blocks: the token count must be a multiple (or smaller)


def fits(num_tokens: int) -> bool:
    return num_tokens <= BLOCK or num_tokens % BLOCK == 0


def fresh_prefill_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, meta: AttentionMetadata, *,
                            scale: float, interpret: bool = False) -> jax.Array:
    """q[T, KVH, G, D]; k_new, v_new[T, KVH, D]: this step's keys and values, tokens in sequence order."""
    T, KVH, G, D = q.shape
    k = jnp.repeat(k_new, G, axis=1).reshape(1, T, KVH * G, D)  # query head h reads kv head h // G
    v = jnp.repeat(v_new, G, axis=1).reshape(1, T, KVH * G, D)
    segments = jnp.where(meta.slot_mapping != INVALID_SLOT, meta.token_seq, -1)[None]  # padding: its own segment
    out = mha(q.reshape(1, T, KVH * G, D), k.astype(q.dtype), v.astype(q.dtype), segments, sm_scale=scale,
              causal=True, interpret=interpret)
    return out.reshape(T, KVH, G, D)
