"""Assemble a DecoderModel of any supported family from a TensorSource (safetensors, GGUF or random weights)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeGuard

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .decoder import DecoderModel, rope_tables
from .gemma3 import GEMMA3_BLOCK_WEIGHTS, Gemma3Block
from .layers import Attention, GatedMLP, ModelAxes
from .llama import LLAMA_BLOCK_WEIGHTS, LlamaBlock
from .quantization import (
    QuantizedTensor,
    QuantizedWeight,
    dequantize_rows,
    quantize_rows,
)

# A tensor source: (Hugging Face name, expected shape) -> array of that shape. Only linear weights (*_proj.weight)
# may come quantized (GGUF Q8_0, a quantized checkpoint, random q8_0 weights).
TensorSource = Callable[[str, tuple[int, ...]], jax.Array | np.ndarray | QuantizedTensor]


def _xp(parts):
    """numpy for host arrays (the GGUF reader's), else jax.numpy: a host array is joined and reshaped on the host,
    where a device array's eager reshape or join compiles a program for each new shape (seconds of a start)."""
    return np if all(isinstance(p, np.ndarray) for p in parts) else jnp


def _join_qkv(xs):
    return _xp(xs).concatenate(xs, axis=1)


def _stack(xs):
    return _xp(xs).stack(xs)


def _named(a, axes) -> hax.NamedArray:
    """hax.named, a host array put on the device first: one transfer (jnp.asarray would compile a program for it)."""
    return hax.named(jax.device_put(a) if isinstance(a, np.ndarray) else a, axes)


def _all_quantized(parts: list[jax.Array | np.ndarray | QuantizedTensor]) -> TypeGuard[list[QuantizedTensor]]:
    return all(isinstance(p, QuantizedTensor) for p in parts)


def _all_dense(parts: list[jax.Array | np.ndarray | QuantizedTensor]) -> TypeGuard[list[jax.Array | np.ndarray]]:
    return not any(isinstance(p, QuantizedTensor) for p in parts)


def build_model(cfg: ModelConfig, source: TensorSource, dtype, quantization: str | None = None) -> DecoderModel:
    """quantization: fp8 or int8 quantizes the dense linear weights at load; a source may also hand over
    QuantizedTensors (a quantized checkpoint), which are kept as they are."""
    ax = ModelAxes.of(cfg)
    E, D, KVH, G, I = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.queries_per_kv, cfg.intermediate_size
    gemma = cfg.family == "gemma3"

    def dense(name: str, shape: tuple[int, ...]) -> jax.Array | np.ndarray:
        """A tensor that is never quantized (norms, biases, embeddings), in the model's dtype."""
        t = source(name, shape)
        assert not isinstance(t, QuantizedTensor), f"{name}: only linear weights come quantized"
        return t.astype(dtype)

    def block(i: int):
        def w(suffix: str, shape: tuple[int, ...], axes: tuple[hax.Axis, ...], reshape=None):
            t = dense(f"model.layers.{i}.{suffix}", shape)
            return _named(t.reshape(reshape) if reshape else t, axes)

        def linears(suffixes, shapes, reshapes, axes, contracted: int, join):
            """Linear weights [out, in] reshaped to the model's axes and joined along an output axis (one matmul
            reads them all); quantized when the checkpoint is or `quantization` asks, dense otherwise."""
            parts = [source(f"model.layers.{i}.{s}", shape) for s, shape in zip(suffixes, shapes, strict=True)]
            blocks = {p.block if isinstance(p, QuantizedTensor) else 0 for p in parts}
            if blocks == {0}:
                pass
            elif len(blocks) == 1 and quantization is None and reshapes[0][-1] % max(blocks) == 0:
                # GGUF Q8_0 kept: every part in blocks of the same size, none straddling the weight's last axis
                block = blocks.pop()
                assert _all_quantized(parts)  # one block size, not 0: every part is in blocks
                values = join([p.values.reshape(r) for p, r in zip(parts, reshapes, strict=True)])
                scale = join([p.scale.reshape(*r[:-1], r[-1] // block) for p, r in zip(parts, reshapes, strict=True)])
                per_block = hax.Axis(f"{axes[-1].name}_blocks", reshapes[0][-1] // block)
                offset = None
                if any(p.offset is not None for p in parts):  # GGUF Q4_1 on CPU (symmetric parts: minimum 0)
                    offsets = [_xp([p.scale]).zeros_like(p.scale) if p.offset is None else p.offset for p in parts]
                    offset = join([o.reshape(*r[:-1], r[-1] // block) for o, r in zip(offsets, reshapes, strict=True)])
                    offset = _named(offset, (*axes[:-1], per_block))
                scale_named = _named(scale, (*axes[:-1], per_block))
                return QuantizedWeight(_named(values, axes), scale_named, block=block, offset=offset)
            else:  # blocks mixed with other formats, or another format asked for: dequantized here
                parts = [dequantize_rows(p) if isinstance(p, QuantizedTensor) and p.block else p for p in parts]
            method = quantization or next((p.method for p in parts if isinstance(p, QuantizedTensor)), None)
            if method is None:
                assert _all_dense(parts)  # no method asked for, none in the checkpoint
                return _named(join([p.astype(dtype).reshape(r) for p, r in zip(parts, reshapes, strict=True)]), axes)
            quantized = [p if isinstance(p, QuantizedTensor) else quantize_rows(p, method) for p in parts]
            assert len({p.method for p in quantized}) == 1, suffixes
            values = join([p.values.reshape(r) for p, r in zip(quantized, reshapes, strict=True)])
            scale = join([p.scale.reshape(r[:-contracted]) for p, r in zip(quantized, reshapes, strict=True)])
            return QuantizedWeight(_named(values, axes), _named(scale, axes[:-contracted]))

        def qkv_bias():
            """q, k and v biases stacked per kv head along ax.QKV, as the fused weight is."""
            parts = [
                dense(f"model.layers.{i}.self_attn.{p}_proj.bias", (n,)).reshape(KVH, n // KVH // D, D)
                for p, n in (("q", KVH * G * D), ("k", KVH * D), ("v", KVH * D))
            ]
            return _named(_join_qkv(parts), (ax.KVHeads, ax.QKV, ax.HeadSize))

        qkv_sizes = (KVH * G * D, KVH * D, KVH * D)
        attn = Attention(
            qkv_proj=linears(
                [f"self_attn.{p}_proj.weight" for p in "qkv"],
                [(n, E) for n in qkv_sizes],
                [(KVH, n // KVH // D, D, E) for n in qkv_sizes],
                (ax.KVHeads, ax.QKV, ax.HeadSize, ax.Embed),
                1,
                _join_qkv,
            ),
            o_proj=linears(
                ["self_attn.o_proj.weight"],
                [(E, KVH * G * D)],
                [(E, KVH, G, D)],
                (ax.Embed, ax.KVHeads, ax.QPerKV, ax.HeadSize),
                3,
                lambda xs: xs[0],
            ),
            qkv_bias=qkv_bias() if cfg.attention_bias else None,
            q_norm=w("self_attn.q_norm.weight", (D,), (ax.HeadSize,)) if cfg.qk_norm else None,
            k_norm=w("self_attn.k_norm.weight", (D,), (ax.HeadSize,)) if cfg.qk_norm else None,
        )
        mlp = GatedMLP(
            gate_up_proj=linears(
                ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                [(I, E)] * 2,
                [(I, E)] * 2,
                (ax.GateUp, ax.Mlp, ax.Embed),
                1,
                _stack,
            ),
            down_proj=linears(["mlp.down_proj.weight"], [(E, I)], [(E, I)], (ax.Embed, ax.Mlp), 1, lambda xs: xs[0]),
        )
        names = GEMMA3_BLOCK_WEIGHTS if gemma else LLAMA_BLOCK_WEIGHTS
        norms = {field: w(hf_name, (E,), (ax.Embed,)) for field, hf_name in names.items()}
        return (Gemma3Block if gemma else LlamaBlock)(attn=attn, mlp=mlp, **norms)

    layers = tuple(block(i) for i in range(cfg.num_layers))

    vocab_shape = (cfg.vocab_size, E)
    embedding = _named(dense("model.embed_tokens.weight", vocab_shape), (ax.Vocab, ax.Embed))
    if cfg.tie_word_embeddings:
        lm_head = embedding
    else:
        lm_head = _named(dense("lm_head.weight", vocab_shape), (ax.Vocab, ax.Embed))
    final_norm = _named(dense("model.norm.weight", (E,)), (ax.Embed,))
    return DecoderModel(
        cfg=cfg,
        ax=ax,
        embedding=embedding,
        layers=layers,
        final_norm=final_norm,
        lm_head=lm_head,
        inv_freq=rope_tables(cfg),
    )
