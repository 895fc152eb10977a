"""PEFT LoRA adapters with random A and B written as PEFT saves them, and the base checkpoint with an adapter merged
into its weights (W + scale * B @ A), which the engine then serves as a plain checkpoint: the reference LoRA must
equal. Written from PEFT's file format alone (numpy and safetensors), not with Capstan's reader."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection, from config.json."""
    E, I = config["hidden_size"], config["intermediate_size"]
    D = config.get("head_dim") or E // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * D, config["num_key_value_heads"] * D
    return {
        "q_proj": (E, q),
        "k_proj": (E, kv),
        "v_proj": (E, kv),
        "o_proj": (q, E),
        "gate_proj": (E, I),
        "up_proj": (E, I),
        "down_proj": (I, E),
    }


def _module(layer: int, module: str) -> str:
    part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{part}.{module}"


def write_adapter(
    folder: Path,
    base: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets=ALL_MODULES,
    rslora: bool = False,
    strength: float = 0.5,
    extra_config: dict | None = None,
) -> Path:
    """A random adapter for the checkpoint at base: A ~ N(0, 1/in), B ~ N(0, strength^2 / r), so the adapter moves
    the logits clearly (B is zero at PEFT's initialisation; a trained one is not)."""
    config = json.loads((base / "config.json").read_text())
    shapes, rng = _shapes(config), np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = shapes[module]
            tensors[f"{_module(layer, module)}.lora_A.weight"] = rng.normal(0, 1 / math.sqrt(fan_in), (rank, fan_in))
            tensors[f"{_module(layer, module)}.lora_B.weight"] = rng.normal(
                0, strength / math.sqrt(rank), (fan_out, rank)
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "use_rslora": rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **(extra_config or {}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return folder


def merge_adapter(base: Path, adapter: Path, out: Path) -> Path:
    """A copy of the checkpoint at base with the adapter merged: W += scale * B @ A, scale alpha / r (alpha / sqrt(r)
    with rsLoRA), as PEFT's merge_and_unload computes it."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(base / "model.safetensors"))
    r = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    for name, a in lora.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[len("base_model.model.") : -len(".lora_A.weight")]
        b = lora[name.replace("lora_A", "lora_B")]
        w = weights[f"{module}.weight"]
        weights[f"{module}.weight"] = (
            w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
        ).astype(w.dtype)
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.name != "model.safetensors" and not f.name.startswith("reference"):
            shutil.copy(f, out / f.name)
    save_file(weights, str(out / "model.safetensors"))
    return out
