"""DecoderModel: embed -> the blocks in order (each writing K/V into its layer's pages) -> norm -> logits.

The families differ only in their block (llama.py, gemma3.py); this is the part they share."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar, Protocol

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from ..attention import AttentionMetadata
from ..kv.cache import KVCache
from ..parallel.mesh import replicated
from .config import SLIDING_ATTENTION, ModelConfig
from .layers import Attention, ModelAxes, Token, embed, lm_logits, rms_norm
from .lora import LayerAdapters, LoRAStack
from .quantization import QuantizedWeight
from .rope import inverse_frequencies, rotary_tables

# Decode steps of at least this many rows run each layer on two halves of the rows in turn
# (CAPSTAN_DECODE_HALVES_MIN_ROWS; 0, the default: never), so that under tensor parallelism one half's all-reduces
# can run while the other half computes. XLA merges the halves back unless its all-reduce combiner and dot merger
# are off for the program (HALVES_COMPILER_OPTIONS: benchmarks/tp_schedule.py shows both). An experiment of issue 31.
HALVES_MIN_ROWS = int(os.environ.get("CAPSTAN_DECODE_HALVES_MIN_ROWS", "0"))
HALVES_COMPILER_OPTIONS: dict[str, str | bool] = {
    "xla_gpu_all_reduce_combine_threshold_bytes": "0",
    "xla_gpu_dot_merger_threshold_mb": "0",
}


class DecoderBlock(Protocol):
    """A family's block (llama.py, gemma3.py): x and this layer's caches in; x and the caches written, out."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # an eqx.Module: a dataclass
    attn: Attention  # tensor_parallel.py splits its projections

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
    ) -> tuple[NamedArray, jax.Array, jax.Array]: ...


class DecoderModel(eqx.Module):
    cfg: ModelConfig = eqx.field(static=True)
    ax: ModelAxes = eqx.field(static=True)
    embedding: NamedArray  # [Vocab, Embed]
    layers: tuple[DecoderBlock, ...]  # the family's blocks (eqx.Modules), one per layer
    final_norm: NamedArray  # [Embed]
    lm_head: NamedArray | QuantizedWeight  # [Vocab, Embed]; the embedding itself when tied (INT8: cpu_layout.py)
    inv_freq: dict[str, jax.Array]  # by layer type: [head_dim // 2] float32
    lora: LoRAStack | None = None  # LoRA adapters in device slots (--enable-lora); None: none can be served

    def __call__(
        self, tokens: jax.Array, meta: AttentionMetadata[jax.Array], kv: KVCache, lora_rows: jax.Array | None = None
    ) -> tuple[NamedArray, KVCache]:
        """Runs T tokens through every layer, writing their K/V; returns hidden states [token, Embed]. lora_rows
        [S]: each sequence row's adapter slot (-1: none); its tokens get that adapter's deltas."""
        cfg = self.cfg
        x = self.embed_tokens(tokens)
        lora = self.lora
        slots = None if lora is None or lora_rows is None else lora_rows[meta.token_seq]  # each token's row's slot
        rope = self.rope(meta)
        k_layers, v_layers = list(kv.k), list(kv.v)
        T = tokens.shape[0]
        halves = HALVES_MIN_ROWS and meta.decode and meta.query_blocks is None and T >= HALVES_MIN_ROWS and T % 2 == 0
        # each part of the rows that a layer runs on in turn: its hidden states, metadata, rope tables and slots
        xs, parts = [x], [(meta, rope, slots)]
        if halves:
            spans = [(0, T // 2), (T // 2, T)]
            xs = [x[Token.name, hax.dslice(lo, hi - lo)] for lo, hi in spans]
            parts = [
                (
                    _decode_rows(meta, lo, hi),
                    {kind: (cos[lo:hi], sin[lo:hi]) for kind, (cos, sin) in rope.items()},
                    None if slots is None else slots[lo:hi],
                )
                for lo, hi in spans
            ]
        # a Python loop, unrolled in the trace: each layer reads and writes its own cache arrays in place, with
        # no slicing of stacked weights or caches between layers
        for i, block in enumerate(self.layers):
            kind = cfg.layer_types[i]
            for p, (part_meta, part_rope, part_slots) in enumerate(parts):
                adapters = None if lora is None or part_slots is None else LayerAdapters(lora.layers[i], part_slots)
                xs[p], k_layers[i], v_layers[i] = self.run_layer(
                    block, kind, xs[p], part_rope[kind], k_layers[i], v_layers[i], part_meta, kv.page_size, adapters
                )
        x = xs[0] if len(xs) == 1 else hax.concatenate(Token.name, xs)
        return self.norm(x), KVCache(tuple(k_layers), tuple(v_layers), kv.page_size)

    # The parts of __call__, in order (engine/layered_step.py runs them as programs of their own)
    def embed_tokens(self, tokens: jax.Array) -> NamedArray:
        x = embed(tokens, self.embedding, self.ax)
        if self.cfg.family == "gemma3":
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, dtype=x.dtype)
        return x

    def rope(self, meta: AttentionMetadata[jax.Array]) -> dict[str, tuple[jax.Array, jax.Array]]:
        """(cos, sin) at the step's positions for each layer type."""
        return {kind: rotary_tables(f, meta.positions) for kind, f in self.inv_freq.items()}

    def run_layer(
        self,
        block: DecoderBlock,
        kind: str,
        x: NamedArray,
        rope: tuple[jax.Array, jax.Array],
        k_cache: jax.Array,
        v_cache: jax.Array,
        meta: AttentionMetadata[jax.Array],
        page_size: int,
        adapters: LayerAdapters | None = None,
    ) -> tuple[NamedArray, jax.Array, jax.Array]:
        """One layer (`block`, of layer type `kind`) on x, writing its K/V into its caches."""
        window = self.cfg.sliding_window if kind == SLIDING_ATTENTION else None
        cos, sin = rope
        return block(x, cos, sin, window, k_cache, v_cache, meta, self.cfg, self.ax, page_size, adapters)

    def norm(self, x: NamedArray) -> NamedArray:
        """The final norm, after the last layer."""
        cfg = self.cfg
        return rms_norm(x, self.final_norm, self.ax.Embed, cfg.rms_norm_eps, one_plus=cfg.family == "gemma3")

    def with_kv_scales(self, scales: list[tuple[float, float]]) -> DecoderModel:
        """The model with each layer's (k_scale, v_scale) for FP8 K/V pages (a checkpoint's; default 1.0)."""
        layers = []
        for block, (k, v) in zip(self.layers, scales, strict=True):
            family_block: Any = block  # every family's block has its Attention as .attn
            layers.append(
                dataclasses.replace(family_block, attn=dataclasses.replace(family_block.attn, k_scale=k, v_scale=v))
            )
        return dataclasses.replace(self, layers=tuple(layers))

    def logits(self, hidden: NamedArray, gather: bool = True) -> NamedArray:
        """Float32 logits [..., Vocab]; under tensor parallelism gathered from the vocabulary shards onto every
        device (and cut to the real vocabulary where it was padded), so sampling sees what one device computes.
        gather=False: left split (and padded) as each device computed them (parallel/vocab_greedy.py reads them)."""
        logits = lm_logits(hidden, self.lm_head, self.ax, self.cfg.final_logit_softcapping)
        if not gather:
            return logits
        logits = hax.named(replicated(logits.array), logits.axes)
        if logits.resolve_axis("vocab").size != self.cfg.vocab_size:
            logits = logits["vocab", hax.dslice(0, self.cfg.vocab_size)]
        return logits


def _decode_rows(meta: AttentionMetadata[jax.Array], lo: int, hi: int) -> AttentionMetadata[jax.Array]:
    """A decode step's rows lo .. hi - 1 as a step of their own (token r is row r's only token)."""
    return AttentionMetadata(
        positions=meta.positions[lo:hi],
        slot_mapping=meta.slot_mapping[lo:hi],
        token_seq=jnp.arange(hi - lo, dtype=meta.token_seq.dtype),
        block_tables=meta.block_tables[lo:hi],
        seq_lens=meta.seq_lens[lo:hi],
        decode=True,
    )


def rope_tables(cfg: ModelConfig) -> dict[str, jax.Array]:
    """Inverse RoPE frequencies for each layer type the config uses."""
    return {
        kind: jnp.asarray(inverse_frequencies(cfg.rope[kind], cfg.head_dim)) for kind in sorted(set(cfg.layer_types))
    }
