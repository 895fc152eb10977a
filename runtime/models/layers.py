"""Building blocks shared by the model families: named axes, RMSNorm, attention over the paged cache, gated MLP.

Every weight is a haliax NamedArray; each layer's block holds its own."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import PartitionSpec as P

from .. import compat  # noqa: F401  (haliax needs jax.core.is_constant_dim on JAX 0.11)
from ..attention import AttentionMetadata, cpu_fuses, decode_fuses, fused_decode, write_and_attend
from ..kernels import cpu_paged_attention
from ..parallel.mesh import MODEL_AXIS, model_parallel_size
from .config import ModelConfig
from .lora import LayerAdapters
from .quantization import QuantizedWeight, linear
from .rope import apply_rotary

Token = hax.Axis("token", 0)  # placeholder size; the real size comes from the step's batch


@dataclasses.dataclass(frozen=True)
class ModelAxes:
    Embed: hax.Axis
    Vocab: hax.Axis
    Mlp: hax.Axis
    KVHeads: hax.Axis
    QPerKV: hax.Axis
    QKV: hax.Axis  # per kv head: its QPerKV query heads, then its key head, then its value head
    GateUp: hax.Axis  # the gate then the up projection of the MLP
    HeadSize: hax.Axis

    @staticmethod
    def of(cfg: ModelConfig) -> ModelAxes:
        return ModelAxes(
            Embed=hax.Axis("embed", cfg.hidden_size),
            Vocab=hax.Axis("vocab", cfg.vocab_size),
            Mlp=hax.Axis("mlp", cfg.intermediate_size),
            KVHeads=hax.Axis("kv_heads", cfg.num_kv_heads),
            QPerKV=hax.Axis("q_per_kv", cfg.queries_per_kv),
            QKV=hax.Axis("qkv", cfg.queries_per_kv + 2),
            GateUp=hax.Axis("gate_up", 2),
            HeadSize=hax.Axis("head_size", cfg.head_dim),
        )


def rms_norm(x: NamedArray, weight: NamedArray, axis: hax.Axis, eps: float, one_plus: bool) -> NamedArray:
    """RMSNorm in float32. one_plus: Gemma's (1 + w) scale, cast after; else Llama's w * cast(normed)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * hax.rsqrt(hax.mean(x32 * x32, axis=axis) + eps)
    if one_plus:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


class Attention(eqx.Module):
    # q, k and v projections fused into one weight: one matmul reads them all (fewer, fuller kernels when decoding)
    qkv_proj: NamedArray | QuantizedWeight  # [KVHeads, QKV, HeadSize, Embed]
    o_proj: NamedArray | QuantizedWeight  # [Embed, KVHeads, QPerKV, HeadSize]
    qkv_bias: NamedArray | None  # [KVHeads, QKV, HeadSize]
    q_norm: NamedArray | None  # [HeadSize]
    k_norm: NamedArray | None
    # what one stored unit of an FP8 K or V page stands for (attention/kv_quantization.py): the checkpoint's
    # self_attn.k_scale / v_scale, else 1.0 (vLLM's default); other cache dtypes ignore them
    k_scale: float = eqx.field(static=True, default=1.0)
    v_scale: float = eqx.field(static=True, default=1.0)

    def __call__(
        self,
        x: NamedArray,
        cos: jax.Array,
        sin: jax.Array,
        window: int | None,
        k_cache: jax.Array,
        v_cache: jax.Array,
        meta: AttentionMetadata[jax.Array],
        cfg: ModelConfig,
        ax: ModelAxes,
        page_size: int,
        lora: LayerAdapters | None = None,
    ):
        """k_cache, v_cache: this layer's [KVHeads, pages, page_size, HeadSize]; lora: the step's adapters (None:
        the base model); returns (y, k_cache, v_cache)."""
        fuses = decode_fuses(
            k_cache, v_cache, meta, head_dim=ax.HeadSize.size, window=window, softcap=cfg.attn_logit_softcapping
        )
        # the q/k/v delta added inside the fused kernel (LayerAdapters.qkv_in_kernel): no kernels of its own
        in_kernel = None
        if lora is not None and fuses and self.qkv_bias is None and model_parallel_size() == 1:
            in_kernel = lora.qkv_in_kernel(x, Token.name, ax)
        if lora is None or in_kernel is not None:
            qkv = linear(x, self.qkv_proj, axis=ax.Embed)
        else:
            qkv = lora.project("qkv", x, self.qkv_proj, ax.Embed, Token.name, ax)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        gemma = cfg.family == "gemma3"
        if fuses:  # one kernel from here to attention's out
            out, k_cache, v_cache = fused_decode(
                qkv.rearrange((Token.name, ax.KVHeads, ax.QKV, ax.HeadSize)).array,
                cos,
                sin,
                k_cache,
                v_cache,
                meta,
                scale=cfg.attention_scale,
                q_norm=None if self.q_norm is None else self.q_norm.array,
                k_norm=None if self.k_norm is None else self.k_norm.array,
                eps=cfg.rms_norm_eps,
                one_plus=gemma,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                lora=in_kernel,
            )
        elif self.q_norm is None and cpu_fuses(qkv.dtype, k_cache, v_cache, head_dim=ax.HeadSize.size):
            # the native CPU kernel from here to attention's out: rope, the K/V write and attention in one call
            # (about ten fewer small XLA ops a layer, each of which costs a one-row step its dispatch)
            out, k_cache, v_cache = cpu_paged_attention.rope_write_attend(
                qkv.rearrange((Token.name, ax.KVHeads, ax.QKV, ax.HeadSize)).array,
                cos,
                sin,
                k_cache,
                v_cache,
                meta,
                scale=cfg.attention_scale,
                window=window,
                softcap=cfg.attn_logit_softcapping,
            )
        else:
            G = ax.QPerKV.size
            q = qkv[ax.QKV.name, hax.dslice(0, G)].rename({ax.QKV.name: ax.QPerKV.name})
            k, v = qkv[ax.QKV.name, G], qkv[ax.QKV.name, G + 1]
            if self.q_norm is not None:
                q = rms_norm(q, self.q_norm, ax.HeadSize, cfg.rms_norm_eps, one_plus=gemma)
                k = rms_norm(k, self.k_norm, ax.HeadSize, cfg.rms_norm_eps, one_plus=gemma)
            q_arr = apply_rotary(q.rearrange((Token.name, ax.KVHeads, ax.QPerKV, ax.HeadSize)).array, cos, sin)
            k_arr = apply_rotary(k.rearrange((Token.name, ax.KVHeads, ax.HeadSize)).array, cos, sin)
            v_arr = v.rearrange((Token.name, ax.KVHeads, ax.HeadSize)).array
            out, k_cache, v_cache = write_and_attend(
                q_arr,
                k_arr,
                v_arr,
                k_cache,
                v_cache,
                meta,
                page_size=page_size,
                scale=cfg.attention_scale,
                window=window,
                softcap=cfg.attn_logit_softcapping,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
            )
        out = hax.named(out, (qkv.resolve_axis(Token.name), ax.KVHeads, ax.QPerKV, ax.HeadSize))
        o_axes = (ax.KVHeads, ax.QPerKV, ax.HeadSize)
        if lora is None:
            y = linear(out, self.o_proj, axis=o_axes)
        else:
            y = lora.project("out", out, self.o_proj, o_axes, Token.name, ax)
        return y, k_cache, v_cache


class GatedMLP(eqx.Module):
    gate_up_proj: NamedArray | QuantizedWeight  # [GateUp, Mlp, Embed]: both projections in one matmul
    down_proj: NamedArray | QuantizedWeight  # [Embed, Mlp]

    def __call__(self, x: NamedArray, cfg: ModelConfig, ax: ModelAxes, lora: LayerAdapters | None = None) -> NamedArray:
        if lora is None:
            gate_up = linear(x, self.gate_up_proj, axis=ax.Embed)
        else:
            gate_up = lora.project("gate_up", x, self.gate_up_proj, ax.Embed, Token.name, ax)
        gate, up = gate_up[ax.GateUp.name, 0], gate_up[ax.GateUp.name, 1]
        act = hax.nn.gelu(gate, approximate=True) if cfg.activation == "gelu_pytorch_tanh" else hax.nn.silu(gate)
        h = act * up
        if lora is None:
            return linear(h, self.down_proj, axis=ax.Mlp)
        return lora.project("down", h, self.down_proj, ax.Mlp, Token.name, ax)


def embed(tokens: jax.Array, embedding: NamedArray, ax: ModelAxes) -> NamedArray:
    if model_parallel_size() == 1:
        x = embedding.array[tokens]
    else:  # the table is split by vocabulary row: look up in place instead of letting XLA gather the whole table
        x = jax.shard_map(_lookup_in_vocab_shard, in_specs=(P(MODEL_AXIS), P()), out_specs=P())(embedding.array, tokens)
    return hax.named(x, (Token.resize(tokens.shape[0]), ax.Embed))


def _lookup_in_vocab_shard(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Megatron's vocabulary-parallel embedding: each device reads the tokens in its rows and zeros for the rest;
    the sum over devices (exact: one term is not zero) is the lookup."""
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(MODEL_AXIS) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[:, None], table[jnp.clip(local, 0, rows - 1)], jnp.zeros((), table.dtype))
    return jax.lax.psum(x, MODEL_AXIS)


def lm_logits(
    hidden: NamedArray, head: NamedArray | QuantizedWeight, ax: ModelAxes, softcap: float | None
) -> NamedArray:
    """Next-token logits in float32 for hidden[..., Embed]; head is [Vocab, Embed] (INT8 on CPUs with INT8 weights:
    cpu_layout.py). Under tensor parallelism each device computes its vocabulary rows' logits, left split (the
    caller gathers them: DecoderModel.logits)."""
    if not isinstance(head, NamedArray):  # QuantizedWeight, or CpuBlockWeight (cpu_layout.py)
        logits = linear(hidden.astype(jnp.float32), head, axis=ax.Embed)
    elif model_parallel_size() == 1:
        logits = hax.dot(hidden, head, axis=ax.Embed, preferred_element_type=jnp.float32).astype(jnp.float32)
    else:  # explicit, or XLA may all-gather the [Vocab, Embed] head every step rather than the far smaller logits
        hidden = hidden.rearrange((..., ax.Embed))
        split = P(*[None] * (hidden.ndim - 1), MODEL_AXIS)
        rows = jax.shard_map(
            lambda h, w: jnp.einsum("...e,ve->...v", h, w, preferred_element_type=jnp.float32),
            in_specs=(P(), P(MODEL_AXIS)),
            out_specs=split,
        )(hidden.array, head.array)
        logits = hax.named(rows, hidden.axes[:-1] + (head.resolve_axis("vocab"),))
    if softcap:
        logits = hax.tanh(logits / softcap) * softcap
    return logits
