"""ModelConfig: the subset of a Hugging Face config.json that Capstan's models read, validated.

A checkpoint we cannot serve correctly is refused here with a message naming the field."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or config value Capstan cannot serve correctly."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # FULL_ATTENTION or SLIDING_ATTENTION, one per layer
    rope: dict[str, RopeConfig]  # by layer type
    sliding_window: int | None = None
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3, Gemma3)
    activation: str = "silu"
    attention_scale: float = 0.0  # softmax scale; 1/sqrt(head_dim) unless the family says otherwise
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        return "gemma3" if self.architecture == "Gemma3ForCausalLM" else "llama"

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear projection of a block, by its Hugging Face module name (what
        LoRA adapters target)."""
        E, I, D = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * D, self.num_kv_heads * D
        return {
            "q_proj": (E, q),
            "k_proj": (E, kv),
            "v_proj": (E, kv),
            "o_proj": (q, E),
            "gate_proj": (E, I),
            "up_proj": (E, I),
            "down_proj": (I, E),
        }

    @staticmethod
    def from_pretrained(path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise UnsupportedModelError(f"{path}: no config.json (is this a Hugging Face checkpoint folder?)")
        return ModelConfig.from_hf(json.loads(file.read_text()))

    @staticmethod
    def from_hf(hf: dict) -> ModelConfig:
        archs = hf.get("architectures") or []
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"config.json architectures={archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        gemma = arch == "Gemma3ForCausalLM"
        num_heads = _req(hf, "num_attention_heads")
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"config.json num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        hidden = _req(hf, "hidden_size")
        head_dim = hf.get("head_dim") or hidden // num_heads
        num_layers = _req(hf, "num_hidden_layers")
        layer_types = _layer_types(hf, arch, num_layers)
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if activation not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"config.json hidden_act={activation!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("config.json mlp_bias=true is not supported")
        # Qwen2 always has q/k/v biases; its config does not say so
        attention_bias = arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False))
        scale = _req(hf, "query_pre_attn_scalar") ** -0.5 if gemma else head_dim**-0.5
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            architecture=arch,
            vocab_size=_req(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            layer_types=layer_types,
            rope=_rope_by_layer_type(hf, set(layer_types)),
            sliding_window=hf.get("sliding_window") if SLIDING_ATTENTION in layer_types else None,
            attention_bias=attention_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            activation=activation,
            attention_scale=scale,
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _req(hf: dict, key: str):
    if hf.get(key) is None:
        raise UnsupportedModelError(f"config.json is missing {key}")
    return hf[key]


def _layer_types(hf: dict, arch: str, num_layers: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types is None:
        window = hf.get("sliding_window")
        if arch == "MistralForCausalLM" and window:
            types = [SLIDING_ATTENTION] * num_layers
        elif arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window") and window:
            start = hf.get("max_window_layers", num_layers)
            types = [SLIDING_ATTENTION if i >= start else FULL_ATTENTION for i in range(num_layers)]
        elif arch == "Gemma3ForCausalLM":
            pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
            types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)]
        else:
            types = [FULL_ATTENTION] * num_layers
    if len(types) != num_layers:
        raise UnsupportedModelError(f"config.json layer_types has {len(types)} entries, num_hidden_layers={num_layers}")
    for t in types:
        if t not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise UnsupportedModelError(f"config.json layer_types entry {t!r} is not supported")
    if SLIDING_ATTENTION in types and not hf.get("sliding_window"):
        raise UnsupportedModelError("config.json layer_types has sliding_attention but sliding_window is not set")
    return tuple(types)


def _rope_by_layer_type(hf: dict, layer_types: set[str]) -> dict[str, RopeConfig]:
    params = hf.get("rope_parameters")
    if params is None:  # transformers 4.x style: rope_theta + rope_scaling
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        if hf.get("architectures", [""])[0] == "Gemma3ForCausalLM":
            local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
            params = {FULL_ATTENTION: params, SLIDING_ATTENTION: local}
    if set(params) & {FULL_ATTENTION, SLIDING_ATTENTION}:
        missing = layer_types - set(params)
        if missing:
            raise UnsupportedModelError(f"config.json rope_parameters has no entry for {sorted(missing)}")
        return {t: _rope(params[t], f"rope_parameters.{t}") for t in layer_types}
    rope = _rope(params, "rope_parameters")
    return {t: rope for t in layer_types}


def _rope(p: dict, where: str) -> RopeConfig:
    rope_type = p.get("rope_type") or p.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json {where}.rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = float(p.get("rope_theta", 10000.0))
    if not math.isfinite(theta) or theta <= 0:
        raise UnsupportedModelError(f"config.json {where}.rope_theta={theta} must be positive")
    factor = float(p.get("factor", 1.0))
    if rope_type != "default" and factor <= 0:
        raise UnsupportedModelError(f"config.json {where}.factor={factor} must be positive")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(p.get("original_max_position_embeddings", 8192)),
    )
