"""Load a Hugging Face checkpoint folder (or build random weights of a named shape) into a DecoderModel."""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Callable

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

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# A tensor source: (Hugging Face name, expected shape) -> array of that shape.
TensorSource = Callable[[str, tuple[int, ...]], jax.Array]


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


def load_model(path: str | Path, dtype: str = "float32") -> DecoderModel:
    """A checkpoint folder with config.json and model.safetensors or sharded safetensors with their index,
    or a .gguf file (dequantized to dtype at load)."""
    path = Path(path)
    if is_gguf(path):
        return load_gguf_model(path, parse_dtype(dtype))
    cfg = ModelConfig.from_pretrained(path)
    return build_model(cfg, _safetensors_source(path), parse_dtype(dtype))


def random_model(cfg: ModelConfig, dtype: str = "bfloat16", seed: int = 0) -> DecoderModel:
    """Random weights of the right shapes, made on the device (benchmarks need no download)."""
    base = jax.random.PRNGKey(seed)

    def source(name: str, shape: tuple[int, ...]) -> jax.Array:
        if name.endswith("norm.weight"):
            return jnp.ones(shape, jnp.float32) if "gemma" not in cfg.family else jnp.zeros(shape, jnp.float32)
        key = jax.random.fold_in(base, zlib.crc32(name.encode()))
        return 0.02 * jax.random.normal(key, shape, parse_dtype(dtype))

    return build_model(cfg, source, parse_dtype(dtype))


def _safetensors_source(path: Path) -> TensorSource:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (path / "model.safetensors").is_file():
        with safe_open(path / "model.safetensors", framework="flax") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise UnsupportedModelError(f"{path}: no model.safetensors or model.safetensors.index.json")
    handles: dict[str, object] = {}

    def source(name: str, shape: tuple[int, ...]) -> jax.Array:
        if name not in weight_map:
            raise UnsupportedModelError(f"{path}: checkpoint has no tensor {name}")
        file = weight_map[name]
        if file not in handles:
            handles[file] = safe_open(path / file, framework="flax")
        tensor = handles[file].get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise UnsupportedModelError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor

    return source


def build_model(cfg: ModelConfig, source: TensorSource, dtype) -> DecoderModel:
    ax = ModelAxes.of(cfg)
    E, D, KVH, G, I = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.queries_per_kv, cfg.intermediate_size
    gemma = cfg.family == "gemma3"

    def block(i: int):
        def w(suffix: str, shape: tuple[int, ...], axes: tuple[hax.Axis, ...], reshape=None):
            t = source(f"model.layers.{i}.{suffix}", shape).astype(dtype)
            return hax.named(t.reshape(reshape) if reshape else t, axes)

        def qkv(kind: str, shape_of, axes):
            """q, k and v tensors of one kind (weight or bias) stacked per kv head along ax.QKV."""
            parts = [source(f"model.layers.{i}.self_attn.{p}_proj.{kind}", shape_of(n)).astype(dtype)
                     .reshape(KVH, n // KVH // D, D, *shape_of(n)[1:]) for p, n in
                     (("q", KVH * G * D), ("k", KVH * D), ("v", KVH * D))]
            return hax.named(jnp.concatenate(parts, axis=1), axes)

        attn = Attention(
            qkv_proj=qkv("weight", lambda n: (n, E), (ax.KVHeads, ax.QKV, ax.HeadSize, ax.Embed)),
            o_proj=w("self_attn.o_proj.weight", (E, KVH * G * D), (ax.Embed, ax.KVHeads, ax.QPerKV, ax.HeadSize),
                     (E, KVH, G, D)),
            qkv_bias=qkv("bias", lambda n: (n,), (ax.KVHeads, ax.QKV, ax.HeadSize)) if cfg.attention_bias else None,
            q_norm=w("self_attn.q_norm.weight", (D,), (ax.HeadSize,)) if cfg.qk_norm else None,
            k_norm=w("self_attn.k_norm.weight", (D,), (ax.HeadSize,)) if cfg.qk_norm else None,
        )
        gate_up = [source(f"model.layers.{i}.mlp.{p}_proj.weight", (I, E)).astype(dtype) for p in ("gate", "up")]
        mlp = GatedMLP(
            gate_up_proj=hax.named(jnp.stack(gate_up), (ax.GateUp, ax.Mlp, ax.Embed)),
            down_proj=w("mlp.down_proj.weight", (E, I), (ax.Embed, ax.Mlp)),
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
