"""LayeredStep: a step shape's stand-in while `capstan serve`'s background thread compiles its whole program.

The whole step (step.py) unrolls every layer into one program: XLA:CPU takes ~0.2 s a layer to compile a prefill
step of the default model (30 layers: ~9 s of a cold start's first two programs, on 2 cores). A LayeredStep runs
the same computation as three programs: the embedding; one layer, compiled once and called for every layer of its
type and weights' structure (each call donating that layer's K/V pages, updated in place); then the final norm,
logits and sampling (step.step_outputs). It compiles in a few seconds (the default model's two first shapes: ~3 s
each instead of ~8 and ~5), costs a dispatch a layer (~4 ms of a ~20 ms one-row decode step on this 2-core
machine), and computes what the whole program does: the same tokens, logprobs equal to float32 rounding (~1e-5:
XLA fuses across a layer's edges in the whole program; tests/test_layered_step.py). The engine runs it only until
the whole program is compiled, which the background thread does first."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp

from ..kv.cache import KVCache
from ..models.decoder import HALVES_MIN_ROWS, DecoderModel
from ..parallel.mesh import model_parallel_size
from ..sampling.sampler import StepOutputs
from ..scheduling.packing import Packed
from .step import step_outputs


def _embed(model: DecoderModel, packed: Packed):
    return model.embed_tokens(packed.unpack().tokens)


def _layer(model: DecoderModel, block, x, k_cache, v_cache, packed: Packed, kind: str, page_size: int):
    """model: without its layers (its config, axes and rope frequencies); block: the layer's weights."""
    meta = packed.unpack().meta
    return model.run_layer(block, kind, x, model.rope(meta)[kind], k_cache, v_cache, meta, page_size)


def _finish(model: DecoderModel, x, packed: Packed) -> StepOutputs:
    return step_outputs(model, model.norm(x), packed.unpack())


_embed_fn = jax.jit(_embed)


@functools.cache
def _layer_fn(kind: str, page_size: int):
    """The jitted layer for one layer type and page size (positional arguments only: JAX's fast call path)."""
    return jax.jit(functools.partial(_layer, kind=kind, page_size=page_size), donate_argnums=(3, 4))


_finish_fn = jax.jit(_finish)


def applies(model: DecoderModel, dtype) -> bool:
    """Whether a step of this model runs layer by layer as a stand-in: on CPU in float32 (in bfloat16 XLA may keep a
    fused value's excess precision across what is a layer's edge here, so tokens could differ; elsewhere the first
    shapes' whole programs compile before /ready, as they did), one device, no LoRA slots (the whole program gathers
    each token's adapter), no split decode halves."""
    on_cpu = jax.default_backend() == "cpu" and jnp.dtype(dtype) == jnp.float32
    return on_cpu and model.lora is None and model_parallel_size() == 1 and not HALVES_MIN_ROWS


class LayeredStep:
    """One step shape (its inputs' layout) compiled layer by layer; called as step_fn is: (model, kv, inputs)."""

    def __init__(self, model: DecoderModel, kv: KVCache, inputs: Packed):
        """Compiles the shape's programs ahead of time, with the arguments a call passes (the model's, the cache's),
        and keeps them: calls run them, never JAX's caches (a program under a second is not in its disk cache)."""
        shell = dataclasses.replace(model, layers=())
        x = jax.eval_shape(_embed, shell, inputs)
        self.embed = _embed_fn.lower(shell, inputs).compile()
        # one program for each layer type and tree structure of its weights
        keys = [(kind, jax.tree.structure(b)) for kind, b in zip(model.cfg.layer_types, model.layers, strict=True)]
        compiled: dict[Hashable, jax.stages.Compiled] = {}
        for i, (key, block) in enumerate(zip(keys, model.layers, strict=True)):
            if key not in compiled:
                layer = _layer_fn(key[0], kv.page_size)
                compiled[key] = layer.lower(shell, block, x, kv.k[i], kv.v[i], inputs).compile()
        self.layers = [compiled[key] for key in keys]
        self.finish = _finish_fn.lower(shell, x, inputs).compile()

    def __call__(self, model: DecoderModel, kv: KVCache, inputs: Packed) -> tuple[KVCache, StepOutputs]:
        shell = dataclasses.replace(model, layers=())
        x = self.embed(shell, inputs)
        ks, vs = list(kv.k), list(kv.v)
        for i, (layer, block) in enumerate(zip(self.layers, model.layers, strict=True)):
            x, ks[i], vs[i] = layer(shell, block, x, ks[i], vs[i], inputs)
        return KVCache(tuple(ks), tuple(vs), kv.page_size), self.finish(shell, x, inputs)
