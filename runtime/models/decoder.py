"""DecoderModel: embed -> a scan over stacked blocks (each writing K/V into the paged cache) -> norm -> logits.

The families differ only in their block (llama.py, gemma3.py); this is the part they share."""
from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from ..attention import AttentionMetadata
from ..kv.cache import KVCache
from .config import SLIDING_ATTENTION, ModelConfig
from .layers import ModelAxes, embed, lm_logits, rms_norm
from .rope import inverse_frequencies, rotary_tables

NO_WINDOW = 1 << 30  # a window wider than any context: full attention


class DecoderModel(eqx.Module):
    cfg: ModelConfig = eqx.field(static=True)
    ax: ModelAxes = eqx.field(static=True)
    embedding: NamedArray  # [Vocab, Embed]
    layers: eqx.Module  # the family's block, every weight stacked on ax.Layers
    final_norm: NamedArray  # [Embed]
    lm_head: NamedArray  # [Vocab, Embed]; the embedding itself when tied
    inv_freq: jax.Array  # [rope tables, head_dim // 2] float32
    layer_rope: jax.Array  # [layers] int32: which rope table each layer uses
    layer_window: jax.Array  # [layers] int32: attention window (NO_WINDOW for full attention)

    def __call__(self, tokens: jax.Array, meta: AttentionMetadata, kv: KVCache) -> tuple[NamedArray, KVCache]:
        """Runs T tokens through every layer, writing their K/V; returns hidden states [token, Embed]."""
        cfg, ax = self.cfg, self.ax
        x = embed(tokens, self.embedding, ax)
        if cfg.family == "gemma3":
            x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype=x.dtype)
        tables = [rotary_tables(self.inv_freq[i], meta.positions) for i in range(self.inv_freq.shape[0])]
        cos_all = jnp.stack([c for c, _ in tables])
        sin_all = jnp.stack([s for _, s in tables])

        def step(carry, xs):
            h, k_cache, v_cache = carry
            block, layer, rope, window = xs
            h, k_cache, v_cache = block(h, layer, cos_all[rope], sin_all[rope], window, k_cache, v_cache, meta,
                                        cfg, ax, kv.page_size)
            return (h, k_cache, v_cache), None

        xs = (self.layers, jnp.arange(cfg.num_layers), self.layer_rope, self.layer_window)
        # unrolled: no loop control between layers, and XLA may fuse across them
        (x, k, v), _ = hax.scan(step, ax.Layers, unroll=cfg.num_layers)((x, kv.k, kv.v), xs)
        x = rms_norm(x, self.final_norm, ax.Embed, cfg.rms_norm_eps, one_plus=cfg.family == "gemma3")
        return x, KVCache(k, v, kv.page_size)

    def logits(self, hidden: NamedArray) -> NamedArray:
        return lm_logits(hidden, self.lm_head, self.ax, self.cfg.final_logit_softcapping)


def layer_schedule(cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(inv_freq tables, per-layer table index, per-layer window) from the config's layer types."""
    kinds = sorted(set(cfg.layer_types))
    inv_freq = jnp.stack([jnp.asarray(inverse_frequencies(cfg.rope[k], cfg.head_dim)) for k in kinds])
    layer_rope = jnp.asarray([kinds.index(t) for t in cfg.layer_types], jnp.int32)
    window = [cfg.sliding_window if t == SLIDING_ATTENTION else NO_WINDOW for t in cfg.layer_types]
    return inv_freq, layer_rope, jnp.asarray(window, jnp.int32)
