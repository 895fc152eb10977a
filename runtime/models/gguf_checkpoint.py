"""GGUF checkpoints (llama.cpp's one-file format): metadata -> ModelConfig, tensors dequantized at load.

Read with llama.cpp's own `gguf` package. GGUF tensor names are mapped onto the Hugging Face names that
build_model asks for, and llama.cpp's conversion edits (Q/K row permutation, Gemma's +1 norms) are undone."""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import jax
import numpy as np

from .builder import build_model
from .config import ModelConfig, UnsupportedModelError
from .gguf_index import GGUFIndex, load_index, save_index
from .quantization import NONE, QuantizedTensor, quantize_blocks

if TYPE_CHECKING:
    from .decoder import DecoderModel

log = logging.getLogger("capstan")
GGUFFile = gguf.GGUFReader | GGUFIndex  # the file as parsed, or its index (the same fields and tensors)
Q8_0_BLOCK = 32
FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
# general.architecture -> the Hugging Face architecture whose block we build
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
GEMMA3_27B_LAYERS = 62  # llama.cpp scales Gemma 3 27B's queries by hidden/heads instead of head_dim (its config)
# Hugging Face name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.")
LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
LLAMA_LAYER_TENSORS = {"post_attention_layernorm": "ffn_norm"}
GEMMA3_LAYER_TENSORS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
TOP_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


@functools.lru_cache(maxsize=1)
def read_gguf(path: str) -> GGUFFile:
    """Parsed once per file and process: the model and the tokenizer both read it. Parsing a 49k vocabulary takes
    seconds, so the first read leaves an index on disk that later processes load instead (gguf_index.py)."""
    if (index := load_index(path)) is not None:
        return index
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise UnsupportedModelError(f"{path}: not a readable GGUF file: {e}") from None
    save_index(reader, path)
    return reader


def field(reader: GGUFFile, key: str, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def architecture(reader: GGUFFile, path: str | Path) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF general.architecture={arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def hf_config(reader: GGUFFile, path: str | Path) -> dict:
    """The GGUF metadata as the config.json it came from, for ModelConfig.from_hf to validate."""
    arch = architecture(reader, path)

    def key(name: str, default=None, required: bool = False):
        value = field(reader, f"{arch}.{name}", default)
        if required and value is None:
            raise UnsupportedModelError(f"{path}: GGUF metadata has no {arch}.{name}")
        if isinstance(value, list):  # per-layer values (e.g. head_count_kv of hybrid models)
            raise UnsupportedModelError(f"{path}: GGUF {arch}.{name} varies by layer, which is not supported")
        return value

    hidden, heads = key("embedding_length", required=True), key("attention.head_count", required=True)
    head_dim = key("attention.key_length") or hidden // heads
    if key("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{path}: GGUF {arch}.attention.value_length differs from key_length")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError(
            f"{path}: GGUF {arch}.rope.dimension_count={key('rope.dimension_count')} "
            f"(partial rotary) is not supported; head size is {head_dim}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{path}: GGUF tensor rope_freqs.weight (Llama 3.1 rope scaling) is not supported")
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(
            f"{path}: GGUF {arch}.rope.scaling.type={scaling!r} is not supported; supported: none, linear"
        )
    num_layers = key("block_count", required=True)
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    hf = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": key("vocab_size") or len(tokens),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": {"rope_type": "linear", "factor": key("rope.scaling.factor")} if scaling == "linear" else None,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "sliding_window": key("attention.sliding_window"),
        "final_logit_softcapping": key("final_logit_softcapping"),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
    }
    if arch == "gemma3":
        pattern = field(reader, f"{arch}.attention.sliding_window_pattern", 6)
        hf |= {
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_local_base_freq": key("rope.freq_base_swa", 10000.0),
            "query_pre_attn_scalar": hidden // heads if num_layers == GEMMA3_27B_LAYERS else head_dim,
        }
        if isinstance(pattern, list):  # one flag per layer: true for a sliding-window layer
            hf["layer_types"] = ["sliding_attention" if swa else "full_attention" for swa in pattern]
        else:
            hf["sliding_window_pattern"] = pattern
    return hf


def load_gguf_model(path: str | Path, dtype, quantization: str | None = None, keep_q8_0: bool = True) -> DecoderModel:
    """Linear weights in Q8_0 are served as they are (int8 in blocks of 32, one scale each); other llama.cpp
    types are dequantized to dtype. quantization (fp8, int8): every linear weight, dequantized, is requantized
    per output channel instead. On CPUs, a file with quantized linear weights has every one of them served in
    Q8_0's blocks (the other llama.cpp types dequantized, then requantized to Q8_0: int8, which XLA's CPU loops
    read without a float copy, quantization.cpu_int8_matmul), unless quantization is "none"."""
    reader = read_gguf(str(path))
    cfg = ModelConfig.from_hf(hf_config(reader, path))
    in_blocks = quantization is None and jax.default_backend() == "cpu" and quantized_linears(reader)
    quantization = None if quantization == NONE else quantization
    if quantization:
        log.info("%s: GGUF weights dequantized, then requantized to %s per output channel", path, quantization)
    if in_blocks:
        log.info(
            "%s: GGUF linear weights kept quantized on CPU (Q4_1 and Q8_0 as written, other types as Q8_0; "
            "--quantization none: dequantized)",
            path,
        )
    return build_model(cfg, gguf_tensor_source(reader, cfg, path, keep_q8_0, in_blocks), dtype, quantization)


def quantized_linears(reader: GGUFFile) -> bool:
    """Whether any linear weight of the file is in a llama.cpp quantized type (not F32, F16 or BF16)."""
    linear = {name for name in LAYER_TENSORS.values() if not name.endswith("norm")}
    return any(
        t.name.split(".")[-2] in linear and t.tensor_type not in FLOAT_TYPES
        for t in reader.tensors
        if t.name.startswith("blk.")
    )


def q4_1_blocks(data: np.ndarray, dims: tuple[int, ...]) -> QuantizedTensor:
    """llama.cpp's Q4_1 as written: per 32 values along a row, a float16 scale d and minimum m, then 16 bytes whose
    low nibbles are values 0-15 and high nibbles values 16-31 (value = d * q + m); q kept as int8 0-15."""
    raw = data.reshape(-1, 4 + Q8_0_BLOCK // 2)
    blocks = dims[:-1] + (dims[-1] // Q8_0_BLOCK,)
    scale = raw[:, :2].copy().view(np.float16).astype(np.float32).reshape(blocks)
    minimum = raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(blocks)
    nibbles = raw[:, 4:]
    values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int8).reshape(dims)
    return QuantizedTensor(values, scale, Q8_0_BLOCK, minimum)


def q8_0_blocks(data: np.ndarray, dims: tuple[int, ...]) -> QuantizedTensor:
    """llama.cpp's Q8_0 as written: per 32 values along a row, a float16 scale then 32 int8 (34 bytes)."""
    raw = data.reshape(-1, 2 + Q8_0_BLOCK)
    scale = raw[:, :2].copy().view(np.float16).astype(np.float32).reshape(*dims[:-1], dims[-1] // Q8_0_BLOCK)
    return QuantizedTensor(raw[:, 2:].copy().view(np.int8).reshape(dims), scale, Q8_0_BLOCK)


def gguf_tensor_source(
    reader: GGUFFile, cfg: ModelConfig, path: str | Path, keep_q8_0: bool = True, in_blocks: bool = False
):
    """keep_q8_0: linear weights in Q8_0 come as QuantizedTensors in their blocks; every other tensor, and those
    too without it, dequantized to float32. in_blocks: linear weights of the other quantized types too, requantized
    to Q8_0 (rows whose length 32 divides). Tensors come as host (numpy) arrays: build_model joins them there and
    puts each weight on the device once (a device array's reshape or join would compile a program per shape)."""
    tensors = {t.name: t for t in reader.tensors}
    arch = architecture(reader, path)
    layer_names = LAYER_TENSORS | (GEMMA3_LAYER_TENSORS if arch == "gemma3" else LLAMA_LAYER_TENSORS)

    def source(hf_name: str, shape: tuple[int, ...]):
        name = gguf_name(hf_name, layer_names)
        if name not in tensors:
            raise UnsupportedModelError(f"{path}: GGUF has no tensor {name} (for {hf_name})")
        t = tensors[name]
        dims = tuple(reversed(t.shape.tolist()))
        if dims != tuple(shape):
            raise UnsupportedModelError(f"{path}: GGUF tensor {name} has shape {dims}, expected {shape}")
        permuted = arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k")
        heads = cfg.num_heads if name.split(".")[-2] == "attn_q" else cfg.num_kv_heads
        kept = t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and keep_q8_0
        kept |= t.tensor_type == gguf.GGMLQuantizationType.Q4_1 and in_blocks  # Q4_1 as written, on CPU
        if kept and hf_name.endswith("_proj.weight"):
            q = (q8_0_blocks if t.tensor_type == gguf.GGMLQuantizationType.Q8_0 else q4_1_blocks)(
                np.asarray(t.data), dims
            )
            if permuted:
                q = QuantizedTensor(
                    unpermute_rows(np.asarray(q.values), heads),
                    unpermute_rows(np.asarray(q.scale), heads),
                    q.block,
                    None if q.offset is None else unpermute_rows(np.asarray(q.offset), heads),
                )
            return q
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:  # gguf's own arithmetic, ~3x faster (the embedding)
            q = q8_0_blocks(np.asarray(t.data), dims)
            values = (q.values.reshape(-1, Q8_0_BLOCK).astype(np.float32) * q.scale.reshape(-1, 1)).reshape(dims)
        else:
            values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(dims)
        if permuted:
            values = unpermute_rows(values, heads)
        linear = hf_name.endswith("_proj.weight") and t.tensor_type not in FLOAT_TYPES
        if in_blocks and linear and dims[-1] % Q8_0_BLOCK == 0:
            return quantize_blocks(values, Q8_0_BLOCK)
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values - 1.0  # llama.cpp stores Gemma's (1 + w) norm scale; we apply the 1 ourselves
        return values.astype(np.float32)

    return source


def gguf_name(hf_name: str, layer_names: dict[str, str]) -> str:
    if hf_name in TOP_TENSORS:
        return TOP_TENSORS[hf_name]
    m = LAYER_NAME.fullmatch(hf_name)
    assert m and m.group(2) in layer_names, hf_name
    return f"blk.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's convert permutation of Q/K rows (rotate-half pairs interleaved for its rope kernel)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
