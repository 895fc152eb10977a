"""Gemma 3 (text): (1+w) RMSNorm before and after attention and MLP, GeGLU, q/k norm, sliding-window layers.

Embedding scaling by sqrt(hidden), query_pre_attn_scalar and per-layer-type RoPE live in config/decoder."""

from __future__ import annotations

import equinox as eqx
from haliax import NamedArray

from .config import ModelConfig
from .layers import Attention, GatedMLP, ModelAxes, rms_norm


class Gemma3Block(eqx.Module):
    input_norm: NamedArray  # [Embed]
    attn: Attention
    post_attn_norm: NamedArray
    pre_mlp_norm: NamedArray
    mlp: GatedMLP
    post_mlp_norm: NamedArray

    def __call__(
        self, x, cos, sin, window, k_cache, v_cache, meta, cfg: ModelConfig, ax: ModelAxes, page_size: int, lora=None
    ):
        eps = cfg.rms_norm_eps
        h = rms_norm(x, self.input_norm, ax.Embed, eps, one_plus=True)
        h, k_cache, v_cache = self.attn(h, cos, sin, window, k_cache, v_cache, meta, cfg, ax, page_size, lora)
        x = x + rms_norm(h, self.post_attn_norm, ax.Embed, eps, one_plus=True)
        h = self.mlp(rms_norm(x, self.pre_mlp_norm, ax.Embed, eps, one_plus=True), cfg, ax, lora)
        return x + rms_norm(h, self.post_mlp_norm, ax.Embed, eps, one_plus=True), k_cache, v_cache


GEMMA3_BLOCK_WEIGHTS = {
    "input_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "pre_mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
