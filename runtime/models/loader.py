"""Load a Hugging Face checkpoint folder (or build random weights of a named shape) into a DecoderModel."""

from __future__ import annotations

import functools
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from .builder import build_model
from .checkpoint_path import is_gguf
from .config import ModelConfig, UnsupportedModelError
from .decoder import DecoderModel
from .gguf_checkpoint import load_gguf_model
from .quantization import (
    FLAG,
    NONE,
    QuantizedTensor,
    check_method,
    quantize_blocks,
)
from .quantized_checkpoint import RAW_DTYPES, checkpoint_quantization, quantized_source, read_raw_tensor

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(name: str):
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(path: str | Path, dtype: str = "float32", quantization: str | None = None) -> DecoderModel:
    """A checkpoint folder with config.json and model.safetensors or sharded safetensors with their index,
    or a .gguf file (dequantized to dtype at load). quantization (fp8, int8) quantizes the linear weights at load;
    a checkpoint quantized already (config.json quantization_config) is served in its own format."""
    check_method(quantization)
    path = Path(path)
    if is_gguf(path):
        return load_gguf_model(path, parse_dtype(dtype), quantization)
    quantization = None if quantization == NONE else quantization
    hf = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    cfg = ModelConfig.from_pretrained(path)
    source = SafetensorsSource(path)
    prequantized = checkpoint_quantization(hf, path)
    if prequantized is None:
        model = build_model(cfg, source, parse_dtype(dtype), quantization)
    elif quantization not in (None, prequantized.method):
        raise UnsupportedModelError(
            f"{FLAG}={quantization}: {path} is quantized already ({prequantized.quant_method}, "
            f"{prequantized.method} weights); leave {FLAG} out or set it to {prequantized.method}"
        )
    else:
        model = build_model(cfg, quantized_source(source, prequantized, path), parse_dtype(dtype))
    scales = checkpoint_kv_scales(source, cfg.num_layers)
    return model if scales is None else model.with_kv_scales(scales)


def checkpoint_kv_scales(source: SafetensorsSource, num_layers: int) -> list[tuple[float, float]] | None:
    """Each layer's (k_scale, v_scale) for FP8 K/V pages from its self_attn.k_scale / v_scale tensors (as
    llm-compressor writes them and vLLM reads them), or None when the checkpoint has none. One value per tensor:
    per-head or per-token scales are refused by name."""
    names = [(f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale") for i in range(num_layers)]
    present = [source.has(n) for pair in names for n in pair]
    if not any(present):
        return None
    if not all(present):
        missing = next(n for pair in names for n in pair if not source.has(n))
        raise UnsupportedModelError(
            f"{source.path}: K/V cache scales are given for some layers only ({missing} is not)"
        )
    scales = []
    for pair in names:
        values = []
        for name in pair:
            a = np.asarray(source(name, None), np.float32)
            if a.size != 1 or not np.isfinite(a).all() or float(a.reshape(())) <= 0:
                raise UnsupportedModelError(
                    f"{source.path}: tensor {name} must be one positive finite scale (per-tensor FP8 K/V scales), "
                    f"got shape {a.shape}"
                )
            values.append(float(a.reshape(())))
        scales.append((values[0], values[1]))
    return scales


def random_model(
    cfg: ModelConfig,
    dtype: str = "bfloat16",
    seed: int = 0,
    quantization: str | None = None,
    split: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None] | None = None,
) -> DecoderModel:
    """Random weights of the right shapes, made on the device (benchmarks need no download). quantization may also
    be "q8_0": the linear weights in GGUF Q8_0's blocks, as a Q8_0 file is served. split(name, shape): where each
    tensor is made (TensorParallel.checkpoint_sharding: a model larger than one device's memory, made in parts)."""
    q8_0 = quantization == "q8_0"
    check_method(None if q8_0 else quantization)
    base = jax.random.PRNGKey(seed)

    def source(name: str, shape: tuple[int, ...]) -> jax.Array | QuantizedTensor:
        where = split(name, shape) if split is not None else None
        if name.endswith("norm.weight"):
            w = jnp.ones(shape, jnp.float32) if "gemma" not in cfg.family else jnp.zeros(shape, jnp.float32)
            return w if where is None else jax.device_put(w, where)
        key = jax.random.fold_in(base, zlib.crc32(name.encode()))
        w = _random_normal(shape, parse_dtype(dtype), where)(key)
        return quantize_blocks(w) if q8_0 and name.endswith("_proj.weight") else w

    return build_model(cfg, source, parse_dtype(dtype), None if q8_0 else quantization)


@functools.cache
def _random_normal(shape: tuple[int, ...], dtype, where: jax.sharding.Sharding | None) -> Callable:
    """One compiled draw per shape and placement (a 70B shape's 560 projections have 7 shapes: one jit each would
    compile 560 times, 5 minutes on four H100s)."""
    draw = lambda key: 0.02 * jax.random.normal(key, shape, dtype)  # noqa: E731
    return draw if where is None else jax.jit(draw, out_shardings=where)


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
