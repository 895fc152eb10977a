"""Quantized Hugging Face checkpoints: config.json's quantization_config read, linear weights loaded quantized.

Served without dequantizing (weights kept as they are, scales as one per output channel):
  compressed-tensors, format float-quantized (FP8 e4m3) or int-quantized (INT8), 8-bit symmetric weights with
  strategy "channel" or "tensor" (a per-tensor scale is broadcast to the rows: exact);
  fp8 (Hugging Face's FP8) with one scale per tensor.
Hugging Face's fine-grained FP8 (weight_block_size, weight_scale_inv per block) is dequantized with its block
scales and requantized to FP8 per output channel at load (logged), since the matmuls here scale per channel.
Anything else is refused naming quant_method and the field."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import UnsupportedModelError
from .quantization import QuantizedTensor, as_numpy_scale, quantize_rows

log = logging.getLogger("capstan")
SUPPORTED = (
    "compressed-tensors (float-quantized FP8 or int-quantized INT8, 8-bit symmetric weights, strategy "
    "channel or tensor) and fp8 (per tensor, or weight_block_size blocks requantized per channel)"
)
LINEAR_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)
# safetensors names the dtypes its own numpy loader cannot build (numpy has no float8)
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    quant_method: str  # "compressed-tensors" or "fp8"
    method: str  # what the weights are served as: "fp8" or "int8"
    scale_suffix: str  # the scale tensor beside each "X.weight": "X.weight_scale" or "X.weight_scale_inv"
    block: tuple[int, int] | None = None  # fp8's weight_block_size, [out, in]


def checkpoint_quantization(hf: dict, path) -> CheckpointQuantization | None:
    """The checkpoint's quantization, or None for a dense one; formats not served here are refused by name."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    where = f"{path}: config.json quantization_config"
    if method == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            log.info(
                "%s: activation_scheme=%r: activations are scaled per token instead", path, qc.get("activation_scheme")
            )
        block = qc.get("weight_block_size")
        if block is not None and len(block) != 2:
            raise UnsupportedModelError(f"{where}.weight_block_size={block!r} must be [rows, columns]")
        return CheckpointQuantization("fp8", "fp8", "weight_scale_inv", tuple(block) if block else None)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        kinds = {"float-quantized": "float", "int-quantized": "int"}
        if fmt not in kinds:
            raise UnsupportedModelError(
                f"{where}: quant_method 'compressed-tensors' with format={fmt!r} is not "
                f"supported; supported: {SUPPORTED}"
            )
        for name, group in (qc.get("config_groups") or {}).items():
            wq = group.get("weights") or {}
            got = (wq.get("num_bits"), wq.get("type"), wq.get("strategy"), wq.get("symmetric", True))
            if got[:2] != (8, kinds[fmt]) or got[2] not in ("channel", "tensor") or not got[3]:
                raise UnsupportedModelError(
                    f"{where}.config_groups.{name}.weights (num_bits={got[0]}, type={got[1]!r}, strategy={got[2]!r}, "
                    f"symmetric={got[3]}) is not supported; supported: {SUPPORTED}"
                )
        return CheckpointQuantization(
            "compressed-tensors", "fp8" if fmt == "float-quantized" else "int8", "weight_scale"
        )
    raise UnsupportedModelError(f"{where}.quant_method={method!r} is not supported; supported: {SUPPORTED}")


def read_raw_tensor(file: Path, name: str) -> np.ndarray:
    """One tensor straight from a safetensors file (its header: 8-byte length, then JSON with dtype, shape and
    data_offsets), for the dtypes RAW_DTYPES lists."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n))[name]
        begin, end = entry["data_offsets"]
        f.seek(8 + n + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, RAW_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def quantized_source(dense_source, q: CheckpointQuantization, path: Path):
    """Wraps the checkpoint's tensor source: a linear weight with a scale beside it comes back as a QuantizedTensor;
    other tensors (and linears left dense, as `ignore` lists) as they are."""
    requantized: list[str] = []

    def source(name: str, shape):
        scale_name = name + q.scale_suffix[len("weight") :]
        if not name.endswith(LINEAR_SUFFIXES) or not dense_source.has(scale_name):
            return dense_source(name, shape)
        values = dense_source(name, shape)
        scale = np.asarray(dense_source(scale_name, None), np.float32)
        want = jnp.float8_e4m3fn if q.method == "fp8" else jnp.int8
        if values.dtype != want:
            raise UnsupportedModelError(
                f"{path}: tensor {name} is {values.dtype}, but quantization_config says {q.method} weights"
            )
        if q.block is not None and scale.size > 1:
            if not requantized:
                log.warning(
                    "%s: FP8 weights in %sx%s blocks are requantized per output channel at load", path, *q.block
                )
            requantized.append(name)
            return quantize_rows(dequantize_blocks(values, scale, q.block), "fp8")
        return QuantizedTensor(jnp.asarray(values), jnp.asarray(as_numpy_scale(scale, shape[0], name)))

    return source


def dequantize_blocks(values, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """values [out, in] times scale [ceil(out / rows), ceil(in / columns)] repeated over its block."""
    rows, cols = block
    out, inp = values.shape
    full = np.repeat(np.repeat(scale, rows, axis=0), cols, axis=1)[:out, :inp]
    return np.asarray(values, np.float32) * full
