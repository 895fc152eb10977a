"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) read and checked against the base model.

What a LoRA adapter of PEFT's format can say and Capstan serves: `r`, `lora_alpha`, `use_rslora` (scale
alpha / sqrt(r) instead of alpha / r), `target_modules` among the q/k/v/o/gate/up/down projections (a list, a regex,
or "all-linear"), `rank_pattern` (each tensor's rank is read from its shape), `layers_to_transform`. Anything else
that changes the function (DoRA, biases, alpha_pattern, modules_to_save, embeddings, fan_in_fan_out) is refused
with a LoRAError naming the field, as are tensors whose shapes do not fit the base model and ranks above the
engine's --max-lora-rank. Reading needs numpy only (ml_dtypes for bfloat16); no JAX."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..models.config import ModelConfig
from .request import LoRAError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (any prefix before layers.N)
TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes; read no more than this
MAX_HEADER_BYTES = 16 << 20  # a safetensors header of an adapter: a few hundred tensors' names, shapes and offsets
# fields that change the function when set, and the value that means "not used"
UNSUPPORTED: dict[str, object] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "alpha_pattern": {},
    "layer_replication": None,
    "lora_bias": False,
}


def resolve_adapter(path: str) -> Path:
    """A local PEFT folder as is; hf://org/name[@revision] downloaded (or found in the cache) as models are."""
    if path.startswith("hf://"):
        repo, _, revision = path[len("hf://") :].partition("@")
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo, revision=revision or None, allow_patterns=[CONFIG, WEIGHTS]))
        except Exception as e:  # no network, no such repo, gated: say which and why
            raise LoRAError(f"{path}: download failed: {type(e).__name__}: {e}", "lora_path") from None
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"{path}: no such adapter folder (a PEFT folder with {CONFIG}, or hf://org/name)", "lora_path")
    return folder


def read_config(folder: Path) -> dict:
    file = folder / CONFIG
    if not file.is_file():
        raise LoRAError(f"{folder}: no {CONFIG} (is this a PEFT LoRA adapter folder?)", "lora_path")
    try:
        size = file.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise LoRAError(f"{file}: {size} bytes, more than an adapter config holds (at most {MAX_CONFIG_BYTES})")
        config = json.loads(file.read_bytes())
    except LoRAError as e:
        raise LoRAError(str(e), "lora_path") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"{file}: not readable JSON: {e}", "lora_path") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{file}: expected a JSON object", "lora_path")
    return config


def check_config(config: dict, where: str) -> None:
    """The fields Capstan serves, with values it serves; the message names the first one that is not."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type!r} is not served; only LORA adapters are", "peft_type")
    for field, unused in UNSUPPORTED.items():
        value = config.get(field, unused)
        if value not in (unused, None) and value != [] and value != {}:
            raise LoRAError(f"{where}: {field}={value!r} is not supported", field)
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias={config['bias']!r} is not supported (only 'none')", "bias")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise LoRAError(f"{where}: {field} must be a positive number, got {value!r}", field)
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in SUPPORTED_MODULES and t != "all-linear"]
        if unknown:
            raise LoRAError(
                f"{where}: target_modules {unknown} are not served; adapters may target {', '.join(SUPPORTED_MODULES)}",
                "target_modules",
            )
    elif targets is not None and not isinstance(targets, str):
        raise LoRAError(f"{where}: target_modules must be a list or a string, got {targets!r}", "target_modules")


def read_safetensors(file: Path, max_bytes: int) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy (its header: 8-byte length, JSON, then the data), each part checked
    before it is used: a LoRAError names the file and what is wrong. max_bytes: the largest file read at all."""

    def bad(problem: str) -> LoRAError:
        return LoRAError(f"{file}: {problem}", "lora_path")

    size = file.stat().st_size
    if size > max_bytes:
        raise bad(f"{size} bytes, more than an adapter of this model at --max-lora-rank can hold ({max_bytes})")
    data = file.read_bytes()
    if len(data) < 8:
        raise bad(f"{len(data)} bytes: not a safetensors file (it starts with an 8-byte header length)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER_BYTES, len(data) - 8):
        raise bad(f"its header length {n} is more than the file's {len(data) - 8} bytes after it (truncated?)")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise bad(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object of tensors")
    payload = len(data) - 8 - n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise bad(f"tensor {name}: expected dtype, shape and data_offsets in the header, got {entry!r:.200}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise LoRAError(f"{file}: tensor {name} has dtype {dtype}, not a float type", name)
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"tensor {name}: shape {shape!r:.200} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise bad(f"tensor {name}: data_offsets {offsets!r:.200} is not [begin, end]")
        begin, end = offsets
        itemsize = np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        if not 0 <= begin <= end <= payload or end - begin != math.prod(shape) * itemsize:
            raise bad(
                f"tensor {name}: data_offsets {offsets} do not hold its {dtype} {shape} within the "
                f"{payload} bytes of data (truncated or corrupt?)"
            )
        tensors[name] = np.frombuffer(
            data, SAFETENSORS_DTYPES[dtype], count=(end - begin) // itemsize, offset=8 + n + begin
        ).reshape(shape)
    return tensors


def _max_file_bytes(cfg: ModelConfig, max_rank: int) -> int:
    """The largest adapter file this model can serve: every projection of every layer at max_rank in float64."""
    per_layer = sum(fan_in + fan_out for fan_in, fan_out in cfg.linear_shapes().values())
    return 8 + MAX_HEADER_BYTES + cfg.num_layers * per_layer * max_rank * 8


def _check_finite(where: str, label: str, half: str, x: np.ndarray, what: str = "holds") -> None:
    bad = x.size - int(np.count_nonzero(np.isfinite(x)))
    if bad:
        raise LoRAError(
            f"{where}: {label}.lora_{half} {what} {bad} NaN or infinite value(s) of {x.size}; an adapter's weights "
            "must be finite (was it saved from a diverged training run?)",
            label,
        )


def read_adapter(folder: Path, cfg: ModelConfig, max_rank: int) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """The adapter's (layer, module) -> (A [r, in], scale * B [out, r]) in float32, checked against the base model's
    projections and the engine's largest rank."""
    shapes, num_layers = cfg.linear_shapes(), cfg.num_layers
    config = read_config(folder)
    where = str(folder)
    check_config(config, where)
    file = folder / WEIGHTS
    if not file.is_file():
        bin_file = folder / "adapter_model.bin"
        hint = (
            f" ({bin_file.name} is PyTorch's pickle: save it with safe_serialization=True)"
            if bin_file.is_file()
            else ""
        )
        raise LoRAError(f"{where}: no {WEIGHTS}{hint}", "lora_path")
    alpha, rslora = float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, tensor in read_safetensors(file, _max_file_bytes(cfg, max_rank)).items():
        m = TENSOR.fullmatch(name)
        if m is None:
            raise LoRAError(
                f"{where}: tensor {name} is not a LoRA A or B weight of a served projection "
                f"({', '.join(SUPPORTED_MODULES)}); embeddings, biases and DoRA magnitudes are not served",
                "target_modules",
            )
        layer, module, half = int(m[1]), m[2], m[3]
        if module not in SUPPORTED_MODULES:
            raise LoRAError(
                f"{where}: tensor {name} targets {module}; adapters may target {', '.join(SUPPORTED_MODULES)}",
                "target_modules",
            )
        if layer >= num_layers:
            raise LoRAError(f"{where}: tensor {name} is for layer {layer}; the model has {num_layers}", name)
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoRAError(f"{file}: holds no LoRA weights", "target_modules")
    modules = {}
    for (layer, module), pair in sorted(halves.items()):
        label = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{where}: {label} has lora_{next(iter(pair))} but not its other half", label)
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out or a.shape[0] != b.shape[1]:
            raise LoRAError(
                f"{where}: {label} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; the base model's {module} "
                f"needs lora_A [r, {fan_in}] and lora_B [{fan_out}, r]",
                label,
            )
        r = a.shape[0]
        if r > max_rank:
            raise LoRAError(
                f"{where}: r={r} ({label}) exceeds --max-lora-rank={max_rank}; raise --max-lora-rank to serve it", "r"
            )
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        _check_finite(str(file), label, "A", a32)
        _check_finite(str(file), label, "B", b32)
        with np.errstate(over="ignore"):
            scaled = b32 * np.float32(scale)
        _check_finite(str(file), label, "B", scaled, f"times the scale {scale:g} (lora_alpha / r) overflows to")
        modules[(layer, module)] = (a32, scaled)
    return modules


def check_adapter(path: str, cfg: ModelConfig, max_rank: int) -> None:
    """Reads and checks an adapter without keeping it (a server's start refuses bad ones before loading the model)."""
    read_adapter(resolve_adapter(path), cfg, max_rank)
