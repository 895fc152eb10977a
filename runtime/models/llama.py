"""Llama family: Llama (incl. llama3 rope scaling), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm)."""

from __future__ import annotations

import equinox as eqx
from haliax import NamedArray

from .config import ModelConfig
from .layers import Attention, GatedMLP, ModelAxes, rms_norm


class LlamaBlock(eqx.Module):
    input_norm: NamedArray  # [Embed]
    attn: Attention
    post_attn_norm: NamedArray  # [Embed]
    mlp: GatedMLP

    def __call__(
        self, x, cos, sin, window, k_cache, v_cache, meta, cfg: ModelConfig, ax: ModelAxes, page_size: int, lora=None
    ):
        h = rms_norm(x, self.input_norm, ax.Embed, cfg.rms_norm_eps, one_plus=False)
        h, k_cache, v_cache = self.attn(h, cos, sin, window, k_cache, v_cache, meta, cfg, ax, page_size, lora)
        x = x + h
        h = rms_norm(x, self.post_attn_norm, ax.Embed, cfg.rms_norm_eps, one_plus=False)
        return x + self.mlp(h, cfg, ax, lora), k_cache, v_cache


# Hugging Face tensor names (after "model.layers.{i}.") for each block field.
LLAMA_BLOCK_WEIGHTS = {
    "input_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
}
