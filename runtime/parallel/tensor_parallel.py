"""TensorParallel: the model split over N devices along one mesh axis (vLLM's --tensor-parallel-size).

Megatron's split, stated with haliax's axis names: the fused q/k/v projection and o_proj by KV head (each device
owns whole KV heads with their query heads, so attention needs no communication), the MLP by its intermediate
columns, the embedding and the LM head by vocabulary row. XLA's partitioner adds the two all-reduces per layer
(after o_proj and down_proj, whose contractions run over the split axis) and the gathers at the vocabulary: the
embedding lookup and the logits, which are gathered whole before sampling (mesh.replicated), so the sampler, its
random draws and the logprobs see exactly what one device would. The KV cache is split by KV head too.

When N exceeds the KV heads (N a multiple of them), each KV head is replicated N / num_kv_heads times, each copy
serving its share of that head's query heads, as vLLM does: identical numbers, N / num_kv_heads times the KV memory.
A vocabulary that N does not divide is padded with zero rows, and the padded logits are cut before sampling.
Quantized weights (models/quantization.py) keep the dense weights' axis names, their per-output-channel scales the
output axes: both split by the same names, so a quantized model splits as the dense one does."""

from __future__ import annotations

import contextlib
import dataclasses

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..models.config import ModelConfig
from ..models.decoder import DecoderModel
from ..models.layers import Attention, ModelAxes
from ..models.quantization import QuantizedWeight
from .mesh import MODEL_AXIS
from .placement import put

SPLIT_AXES = ("kv_heads", "mlp", "vocab")  # haliax axis names split along the model axis; all others replicated
FLAG = "--tensor-parallel-size"


class TensorParallelError(ValueError):
    """A tensor-parallel size this model or machine cannot run."""


def check_size(cfg: ModelConfig, size: int, num_devices: int) -> None:
    """Refuses a size the model's heads or MLP cannot split evenly, or that exceeds the devices."""
    if size < 1:
        raise TensorParallelError(f"{FLAG} must be at least 1, got {size}")
    if size > num_devices:
        raise TensorParallelError(f"{FLAG}={size} exceeds the {num_devices} {jax.default_backend()} device(s) here")
    if cfg.num_heads % size:
        raise TensorParallelError(f"{FLAG}={size} must divide the model's num_attention_heads={cfg.num_heads}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise TensorParallelError(
            f"{FLAG}={size} must divide the model's num_key_value_heads={cfg.num_kv_heads} or be a multiple of it "
            f"(then each KV head is replicated)"
        )
    if cfg.intermediate_size % size:
        raise TensorParallelError(f"{FLAG}={size} must divide the model's intermediate_size={cfg.intermediate_size}")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    mesh: Mesh | None  # None: one device, nothing is placed or split

    @staticmethod
    def create(size: int, cfg: ModelConfig) -> TensorParallel:
        """The first `size` devices as a mesh with one axis; with jax.distributed, size counts every host's devices."""
        devices = jax.devices()
        check_size(cfg, size, len(devices))
        if jax.process_count() > 1 and size != len(devices):
            raise TensorParallelError(
                f"{FLAG}={size}: across {jax.process_count()} hosts it must equal the devices of "
                f"all of them ({len(devices)}), so that every host holds its part of the mesh"
            )
        if size == 1:
            return TensorParallel(None)
        return TensorParallel(Mesh(np.asarray(devices[:size]), (MODEL_AXIS,)))

    @property
    def size(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[MODEL_AXIS]

    def context(self):
        """The mesh that jitted steps trace and run under (attention's shard_map and the logits' gather read it)."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def place_model(self, model: DecoderModel) -> DecoderModel:
        """The model with KV heads replicated as the size needs, the vocabulary padded to a multiple of it, and
        every weight placed on the mesh, split along SPLIT_AXES."""
        if self.mesh is None:
            return model
        if any(
            isinstance(w, QuantizedWeight) and w.block
            for w in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, QuantizedWeight))
        ):
            raise TensorParallelError(
                f"{FLAG}={self.size}: GGUF Q8_0 weights are served in their blocks on one device "
                f"only; add --quantization int8 to requantize them per output channel"
            )
        model = replicate_kv_heads(model, self.size)
        model = _pad_vocab(model, self.size)
        placed: dict[int, NamedArray] = {}  # a tied LM head is the embedding itself: place it once

        def place(x):
            if isinstance(x, NamedArray):
                if id(x) not in placed:
                    spec = P(*(MODEL_AXIS if a.name in SPLIT_AXES else None for a in x.axes))
                    placed[id(x)] = hax.named(self._put(x.array, spec), x.axes)
                return placed[id(x)]
            return self._put(x, P())

        return jax.tree.map(place, model, is_leaf=lambda x: isinstance(x, NamedArray))

    def checkpoint_sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding | None:
        """Where a checkpoint tensor (Hugging Face name and [out, in] layout) is made so that no device ever holds
        the whole model (a 70B model is 140 GB in bf16): split along the axis that place_model splits, replicated
        where that axis does not divide; place_model then moves at most a layer's worth between devices."""
        if self.mesh is None:
            return None
        axis = checkpoint_split_axis(name)
        spec: list[str | None] = [None] * len(shape)
        if axis is not None and shape[axis] % self.size == 0:
            spec[axis] = MODEL_AXIS
        return NamedSharding(self.mesh, P(*spec))

    def kv_sharding(self) -> NamedSharding | None:
        """KV cache arrays [kv_heads, pages, page_size, head_dim]: split by KV head."""
        return None if self.mesh is None else NamedSharding(self.mesh, P(MODEL_AXIS))

    def replicated(self, tree):
        """Every array of tree whole on every device of the mesh (LoRA adapters' slots: models/lora.py)."""
        return tree if self.mesh is None else jax.tree.map(lambda x: self._put(x, P()), tree)

    def inputs_sharding(self) -> NamedSharding | None:
        """Step inputs: the same on every device."""
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    def _put(self, x, spec: P) -> jax.Array:
        assert self.mesh is not None, "placed only on a mesh"
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # made in parts on the mesh (checkpoint_sharding)
            return jax.device_put(x, NamedSharding(self.mesh, spec))
        return put(x, NamedSharding(self.mesh, spec))  # each host holds the whole value and puts its devices' parts


def checkpoint_split_axis(name: str) -> int | None:
    """The axis of a Hugging Face tensor that SPLIT_AXES come from: the output rows of the q/k/v, gate and up
    projections (KV heads, MLP columns) and of the vocabulary tables; the input columns of o_proj and down_proj."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    if name.endswith(("_proj.weight", "_proj.bias", "embed_tokens.weight", "lm_head.weight")):
        return 0
    return None  # norms: replicated


def replicate_kv_heads(model: DecoderModel, size: int) -> DecoderModel:
    """The same function with max(num_kv_heads, size) KV heads: query heads keep their order, and KV head j of
    the result is head j // r of the model's (r = size / num_kv_heads), serving its r-th share of query heads."""
    cfg = model.cfg
    r = size // cfg.num_kv_heads
    if r <= 1:
        return model
    G, KVH = cfg.queries_per_kv, cfg.num_kv_heads
    new_cfg = dataclasses.replace(cfg, num_kv_heads=KVH * r)
    ax = ModelAxes.of(new_cfg)

    def fused(w: jax.Array) -> jax.Array:
        """[KVH, G + 2, ...] (q heads, k, v) -> [KVH * r, G / r + 2, ...]."""
        rest = w.shape[2:]
        q = w[:, :G].reshape(KVH * r, G // r, *rest)
        kv = jnp.repeat(w[:, G:], r, axis=0)
        return jnp.concatenate([q, kv], axis=1)

    def qkv(w):
        """The fused projection re-split; a quantized one's per-channel scales [KVH, G + 2, HeadSize] alike."""
        if isinstance(w, QuantizedWeight):
            return QuantizedWeight(qkv(w.weight), hax.named(fused(w.scale.array), (ax.KVHeads, ax.QKV, ax.HeadSize)))
        return hax.named(fused(w.array), (ax.KVHeads, ax.QKV, ax.HeadSize, ax.Embed))

    def out(w):
        """o_proj [Embed, KVH, G, HeadSize] with the query heads regrouped; a quantized one's scales are [Embed]."""
        if isinstance(w, QuantizedWeight):
            return dataclasses.replace(w, weight=out(w.weight))
        o = w.array
        return hax.named(
            o.reshape(o.shape[0], KVH * r, G // r, o.shape[-1]), (ax.Embed, ax.KVHeads, ax.QPerKV, ax.HeadSize)
        )

    def attention(a: Attention) -> Attention:
        return dataclasses.replace(
            a,
            qkv_proj=qkv(a.qkv_proj),
            o_proj=out(a.o_proj),
            qkv_bias=None
            if a.qkv_bias is None
            else hax.named(fused(a.qkv_bias.array), (ax.KVHeads, ax.QKV, ax.HeadSize)),
        )

    layers = tuple(dataclasses.replace(b, attn=attention(b.attn)) for b in model.layers)
    return dataclasses.replace(model, cfg=new_cfg, ax=ax, layers=layers)


def _pad_vocab(model: DecoderModel, size: int) -> DecoderModel:
    """Zero rows up to a multiple of size; DecoderModel.logits cuts the logits back to cfg.vocab_size."""
    pad = -model.cfg.vocab_size % size
    if not pad:
        return model

    def padded(w: NamedArray) -> NamedArray:
        Vocab = w.resolve_axis("vocab")
        return hax.named(jnp.pad(w.array, ((0, pad), (0, 0))), (Vocab.resize(Vocab.size + pad), w.axes[1]))

    assert isinstance(model.lm_head, NamedArray), "the LM head is INT8 on one CPU only (cpu_layout.py)"
    assert model.embedding.axes[0].name == "vocab" and model.lm_head.axes[0].name == "vocab"
    embedding = padded(model.embedding)
    lm_head = embedding if model.lm_head is model.embedding else padded(model.lm_head)
    return dataclasses.replace(model, embedding=embedding, lm_head=lm_head)
