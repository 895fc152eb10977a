"""The CPU's layout of a model whose linear weights are INT8 (--quantization int8; a quantized GGUF's default on
CPUs): what XLA's CPU matrix-vector loops read fastest (quantization.cpu_int8_matmul).

- A weight contracted over several axes (o_proj: kv heads, queries per head, head size) keeps them flattened into
  one: XLA's fused loop walks a multi-axis weight with per-element index arithmetic, 10x slower (576 x 576 int8:
  228 against 16 us; SmolLM2-135M: 9 of a decode step's 24 ms).
- The LM head is quantized to INT8 in Q8_0's blocks of 32 as well (the embedding table stays: lookups read a row):
  at one row it is the largest matrix (the tied 49,152 x 576 table: 113 MB a step in float32, 28 MB in INT8).
- Where the native kernel is built (kernels/cpu_block_matmul.py, `make setup`), every weight in blocks of 32
  (Q4_1, Q8_0, the LM head's) becomes a CpuBlockWeight: packed as that kernel reads it (Q4_1 two values a byte),
  multiplied with int8 dot products on all of the host's cores (CAPSTAN_CPU_NATIVE_MATMUL=0: XLA's loops instead).
Only for one device: tensor parallelism splits weights by the axes this merges."""

from __future__ import annotations

import dataclasses
import logging
import os

import equinox as eqx
import haliax as hax
import jax
import numpy as np

from ..kernels import cpu_block_matmul
from .cpu_block_weight import CpuBlockWeight
from .decoder import DecoderModel
from .quantization import QuantizedWeight, flat_axis_name, quantize_blocks

log = logging.getLogger(__name__)
Q8_0_BLOCK = 32  # the LM head's blocks: GGUF Q8_0's
# "1" (default): the native kernel where it is built (its two activation levels: the float path's answers), 1.04-1.15x
# XLA's loops at one stream and 1.12-1.18x at 16 through `capstan serve` (benchmarks/RESULTS.md, issue 66); "0": XLA's loops
NATIVE_MATMUL = os.environ.get("CAPSTAN_CPU_NATIVE_MATMUL", "1")


def _int8(w) -> bool:
    return isinstance(w, QuantizedWeight) and w.method == "int8"


def _flat_o_proj(block):
    """The block with its o_proj's contracted axes (all but the first, Embed) flattened into one, its block scales'
    likewise (blocks run along the last axis, so they stay in order)."""
    w = block.attn.o_proj
    if not _int8(w):
        return block
    contracted = w.weight.axes[1:]
    name = flat_axis_name([a.name for a in contracted])
    weight = hax.flatten_axes(w.weight, contracted, name)
    scale = hax.flatten_axes(w.scale, w.scale.axes[1:], name + "_blocks") if w.block else w.scale
    offset = None if w.offset is None else hax.flatten_axes(w.offset, w.offset.axes[1:], name + "_blocks")
    flat = QuantizedWeight(weight, scale, block=w.block, offset=offset)
    return eqx.tree_at(lambda b: b.attn.o_proj, block, flat)


def cpu_int8_layout(model: DecoderModel) -> DecoderModel:
    """The model as a CPU reads it fastest, when its linear weights are INT8; unchanged otherwise."""
    weights = jax.tree.leaves(model.layers, is_leaf=lambda w: isinstance(w, QuantizedWeight))
    if not any(_int8(w) for w in weights):
        return model
    layers = tuple(_flat_o_proj(block) for block in model.layers)
    head = model.lm_head
    if not isinstance(head, QuantizedWeight) and head.axes[-1].size % Q8_0_BLOCK == 0:
        q = quantize_blocks(np.asarray(head.array), Q8_0_BLOCK)  # on the host: no program compiled for it
        blocks = head.axes[-1].resize(head.axes[-1].size // Q8_0_BLOCK).alias(head.axes[-1].name + "_blocks")
        head = QuantizedWeight(
            hax.named(jax.device_put(q.values), head.axes),
            hax.named(jax.device_put(q.scale), (head.axes[0], blocks)),
            block=Q8_0_BLOCK,
        )
    if NATIVE_MATMUL != "0" and cpu_block_matmul.available():
        layers = jax.tree.map(_native, layers, is_leaf=lambda w: isinstance(w, QuantizedWeight))
        head = _native(head)
    return dataclasses.replace(model, layers=layers, lm_head=head)


def _native(w):
    """A weight in blocks of 32, its contracted axes flattened into its last (all of them, after _flat_o_proj), as
    the native kernel reads it; anything else unchanged."""
    if _int8(w) and w.block == cpu_block_matmul.BLOCK and w.weight.ndim >= 2:
        try:
            return CpuBlockWeight.from_quantized(w, contracted=1)
        except ValueError as e:  # scales beyond float16's range: the kernel's layout cannot hold them
            log.warning("a weight stays on XLA's path: %s", e)
    return w
