"""Load a Hugging Face checkpoint folder (or build random weights of a named shape) into a DecoderModel."""
from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
from safetensors import safe_open

from .config import ModelConfig, UnsupportedModelError
from .decoder import DecoderModel, rope_tables
from .gemma3 import GEMMA3_BLOCK_WEIGHTS, Gemma3Block
from .gguf_checkpoint import is_gguf, load_gguf_model
from .layers import Attention, GatedMLP, ModelAxes
from .llama import LLAMA_BLOCK_WEIGHTS, LlamaBlock
from .quantization import (
    FLAG,
    QuantizedTensor,
    QuantizedWeight,
    check_method,
    dequantize_rows,
    quantize_blocks,
    quantize_rows,
)
from .quantized_checkpoint import RAW_DTYPES, checkpoint_quantization, quantized_source, read_raw_tensor

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# A tensor source: (Hugging Face name, expected shape) -> array of that shape.
TensorSource = Callable[[str, tuple[int, ...]], jax.Array | QuantizedTensor]


def parse_dtype(name: str):
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_checkpoint(model: str | Path) -> Path:
    """A local folder or .gguf file as is; hf://org/name[@revision] downloaded (or found in the cache)."""
    text = str(model)
    if text.startswith("hf://"):
        repo, _, revision = text[len("hf://"):].partition("@")
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo, revision=revision or None,
                                          allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
        except Exception as e:  # no network, no such repo, gated: say which and why
            raise UnsupportedModelError(f"model {text}: download failed: {type(e).__name__}: {e}") from None
    path = Path(text)
    if not (path.is_dir() or is_gguf(path)):
        raise UnsupportedModelError(f"model {text}: no such checkpoint folder or .gguf file (or use hf://org/name)")
    return path


def load_model(path: str | Path, dtype: str = "float32", quantization: str | None = None) -> DecoderModel:
    """A checkpoint folder with config.json and model.safetensors or sharded safetensors with their index,
    or a .gguf file (dequantized to dtype at load). quantization (fp8, int8) quantizes the linear weights at load;
    a checkpoint quantized already (config.json quantization_config) is served in its own format."""
    check_method(quantization)
    path = Path(path)
    if is_gguf(path):
        return load_gguf_model(path, parse_dtype(dtype), quantization)
    hf = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    cfg = ModelConfig.from_pretrained(path)
    source = SafetensorsSource(path)
    prequantized = checkpoint_quantization(hf, path)
    if prequantized is None:
        return build_model(cfg, source, parse_dtype(dtype), quantization)
    if quantization not in (None, prequantized.method):
        raise UnsupportedModelError(f"{FLAG}={quantization}: {path} is quantized already ({prequantized.quant_method}, "
                                    f"{prequantized.method} weights); leave {FLAG} out or set it to {prequantized.method}")
    return build_model(cfg, quantized_source(source, prequantized, path), parse_dtype(dtype))


def random_model(cfg: ModelConfig, dtype: str = "bfloat16", seed: int = 0, quantization: str | None = None) -> DecoderModel:
    """Random weights of the right shapes, made on the device (benchmarks need no download). quantization may also
    be "q8_0": the linear weights in GGUF Q8_0's blocks, as a Q8_0 file is served."""
    q8_0 = quantization == "q8_0"
    check_method(None if q8_0 else quantization)
    base = jax.random.PRNGKey(seed)

    def source(name: str, shape: tuple[int, ...]) -> jax.Array | QuantizedTensor:
        if name.endswith("norm.weight"):
            return jnp.ones(shape, jnp.float32) if "gemma" not in cfg.family else jnp.zeros(shape, jnp.float32)
        key = jax.random.fold_in(base, zlib.crc32(name.encode()))
        w = 0.02 * jax.random.normal(key, shape, parse_dtype(dtype))
        return quantize_blocks(w) if q8_0 and name.endswith("_proj.weight") else w

    return build_model(cfg, source, parse_dtype(dtype), None if q8_0 else quantization)


class SafetensorsSource:
    """The tensors of a checkpoint folder: model.safetensors, or shards listed by model.safetensors.index.json."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            with safe_open(path / "model.safetensors", framework="flax") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 - safe_open handles do not iterate
        else:
            raise UnsupportedModelError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.path = path
        self.handles: dict[str, Any] = {}  # safetensors handles (untyped)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def __call__(self, name: str, shape: tuple[int, ...] | None) -> jax.Array:
        """The tensor, checked against the shape the model expects (None: any shape)."""
        if name not in self.weight_map:
            raise UnsupportedModelError(f"{self.path}: checkpoint has no tensor {name}")
        file = self.weight_map[name]
        if file not in self.handles:
            self.handles[file] = safe_open(self.path / file, framework="flax")
        if self.handles[file].get_slice(name).get_dtype() in RAW_DTYPES:  # float8: safetensors' loader lacks it
            tensor = jnp.asarray(read_raw_tensor(self.path / file, name))
        else:
            tensor = self.handles[file].get_tensor(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise UnsupportedModelError(f"{self.path}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor


def build_model(cfg: ModelConfig, source: TensorSource, dtype, quantization: str | None = None) -> DecoderModel:
    """quantization: fp8 or int8 quantizes the dense linear weights at load; a source may also hand over
    QuantizedTensors (a quantized checkpoint), which are kept as they are."""
    ax = ModelAxes.of(cfg)
    E, D, KVH, G, I = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.queries_per_kv, cfg.intermediate_size
    gemma = cfg.family == "gemma3"

    def block(i: int):
        def w(suffix: str, shape: tuple[int, ...], axes: tuple[hax.Axis, ...], reshape=None):
            t = source(f"model.layers.{i}.{suffix}", shape).astype(dtype)
            return hax.named(t.reshape(reshape) if reshape else t, axes)

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
                values = join([p.values.reshape(r) for p, r in zip(parts, reshapes, strict=True)])
                scale = join([p.scale.reshape(*r[:-1], r[-1] // block) for p, r in zip(parts, reshapes, strict=True)])
                per_block = hax.Axis(f"{axes[-1].name}_blocks", reshapes[0][-1] // block)
                return QuantizedWeight(hax.named(values, axes), hax.named(scale, (*axes[:-1], per_block)), block=block)
            else:  # blocks mixed with other formats, or another format asked for: dequantized here
                parts = [dequantize_rows(p) if isinstance(p, QuantizedTensor) and p.block else p for p in parts]
            method = quantization or next((p.method for p in parts if isinstance(p, QuantizedTensor)), None)
            if method is None:
                return hax.named(join([p.astype(dtype).reshape(r) for p, r in zip(parts, reshapes, strict=True)]), axes)
            parts = [p if isinstance(p, QuantizedTensor) else quantize_rows(p, method) for p in parts]
            assert len({p.method for p in parts}) == 1, suffixes
            values = join([p.values.reshape(r) for p, r in zip(parts, reshapes, strict=True)])
            scale = join([p.scale.reshape(r[:-contracted]) for p, r in zip(parts, reshapes, strict=True)])
            return QuantizedWeight(hax.named(values, axes), hax.named(scale, axes[:-contracted]))

        def qkv_bias():
            """q, k and v biases stacked per kv head along ax.QKV, as the fused weight is."""
            parts = [source(f"model.layers.{i}.self_attn.{p}_proj.bias", (n,)).astype(dtype).reshape(KVH, n // KVH // D, D)
                     for p, n in (("q", KVH * G * D), ("k", KVH * D), ("v", KVH * D))]
            return hax.named(jnp.concatenate(parts, axis=1), (ax.KVHeads, ax.QKV, ax.HeadSize))

        qkv_sizes = (KVH * G * D, KVH * D, KVH * D)
        attn = Attention(
            qkv_proj=linears([f"self_attn.{p}_proj.weight" for p in "qkv"], [(n, E) for n in qkv_sizes],
                             [(KVH, n // KVH // D, D, E) for n in qkv_sizes],
                             (ax.KVHeads, ax.QKV, ax.HeadSize, ax.Embed), 1, lambda xs: jnp.concatenate(xs, axis=1)),
            o_proj=linears(["self_attn.o_proj.weight"], [(E, KVH * G * D)], [(E, KVH, G, D)],
                           (ax.Embed, ax.KVHeads, ax.QPerKV, ax.HeadSize), 3, lambda xs: xs[0]),
            qkv_bias=qkv_bias() if cfg.attention_bias else None,
            q_norm=w("self_attn.q_norm.weight", (D,), (ax.HeadSize,)) if cfg.qk_norm else None,
            k_norm=w("self_attn.k_norm.weight", (D,), (ax.HeadSize,)) if cfg.qk_norm else None,
        )
        mlp = GatedMLP(
            gate_up_proj=linears(["mlp.gate_proj.weight", "mlp.up_proj.weight"], [(I, E)] * 2, [(I, E)] * 2,
                                 (ax.GateUp, ax.Mlp, ax.Embed), 1, jnp.stack),
            down_proj=linears(["mlp.down_proj.weight"], [(E, I)], [(E, I)], (ax.Embed, ax.Mlp), 1, lambda xs: xs[0]),
        )
        names = GEMMA3_BLOCK_WEIGHTS if gemma else LLAMA_BLOCK_WEIGHTS
        norms = {field: w(hf_name, (E,), (ax.Embed,)) for field, hf_name in names.items()}
        return (Gemma3Block if gemma else LlamaBlock)(attn=attn, mlp=mlp, **norms)

    layers = tuple(block(i) for i in range(cfg.num_layers))

    vocab_shape = (cfg.vocab_size, E)
    embedding = hax.named(source("model.embed_tokens.weight", vocab_shape).astype(dtype), (ax.Vocab, ax.Embed))
    if cfg.tie_word_embeddings:
        lm_head = embedding
    else:
        lm_head = hax.named(source("lm_head.weight", vocab_shape).astype(dtype), (ax.Vocab, ax.Embed))
    final_norm = hax.named(source("model.norm.weight", (E,)).astype(dtype), (ax.Embed,))
    return DecoderModel(cfg=cfg, ax=ax, embedding=embedding, layers=layers, final_norm=final_norm, lm_head=lm_head,
                        inv_freq=rope_tables(cfg))
