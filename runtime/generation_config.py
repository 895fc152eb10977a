"""The model's own sampling defaults, as vLLM's `--generation-config` and `--override-generation-config` mean them.

A request field left out takes, in order: `--override-generation-config`, then the model's generation config
(generation_config.json beside the weights, a GGUF file's `general.sampling.*` keys, or, for the default model,
its publisher's recommendation), then SamplingParams' own default. `--generation-config vllm` ignores the model's.
Computed from the EngineConfig and the checkpoint's files only: the HTTP frontend needs neither JAX nor the weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from .gguf_metadata import GGUFMetadataError, read_metadata
from .sampling_keys import SamplingDefaults, check_fields, parse_sampling_keys

if TYPE_CHECKING:
    from .config import EngineConfig

log = logging.getLogger("capstan")
GENERATION_CONFIG_FILE = "generation_config.json"
# llama.cpp's GGUF keys (gguf.Keys.General.SAMPLING_*) -> SamplingParams field
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# The default model's card (HuggingFaceTB/SmolLM2-135M-Instruct) samples with temperature 0.2 and top_p 0.9; its
# files carry none. With those alone, the Q4_1 file's near-tied first tokens send ~3 in 10 one-line answers into a
# loop until the context ends; a repetition penalty of 1.1 (ours, not the card's) ended 15 of 15 with EOS. Some
# greetings still ran on as a stream of ever new emoji (each several byte tokens that begin alike, so neither the
# repetition penalty nor DRY stops it); a frequency penalty of 0.3 counts those leading bytes and ends 93 of 96
# one-line answers against 82. With the repetition penalty leaving the stop tokens (the template's <|im_end|>,
# written after every message of the prompt) alone, a presence penalty of 0.3 did best offline: 94 of 96 within
# 400 tokens, and 39 of 40 extra greeting draws within 1,000 (issue 67; benchmarks/RESULTS.md).
SMOLLM2_RECOMMENDED: SamplingDefaults = {
    "temperature": 0.2,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.3,
    "presence_penalty": 0.3,
}


def sampling_defaults(config: EngineConfig) -> SamplingDefaults:
    """SamplingParams fields a request (or LLM.generate without sampling_params) takes when it leaves them out."""
    model = {} if config.generation_config == "vllm" else model_defaults(config.checkpoint, config.generation_config)
    override = parse_sampling_keys(config.override_generation_config or {}, "--override-generation-config", strict=True)
    return {**model, **override}


def describe(defaults: SamplingDefaults, config: EngineConfig) -> str:
    """One log line: which defaults are in force and where they came from."""
    if not defaults:
        return "default sampling parameters: SamplingParams' own (the model's generation config has none)"
    source = (
        "--override-generation-config"
        if config.generation_config == "vllm"
        else (
            f"the model's generation config ({config.generation_config})"
            + (" and --override-generation-config" if config.override_generation_config else "")
        )
    )
    fields = ", ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
    return (
        f"default sampling parameters from {source}: {fields}; a request's own fields win "
        "(--generation-config vllm ignores the model's)"
    )


def model_defaults(model: str, source: str = "auto") -> SamplingDefaults:
    """The sampling defaults the checkpoint recommends. source: "auto" (the checkpoint's own files) or a folder
    holding a generation_config.json."""
    if source != "auto":
        return _json_defaults(Path(source) / GENERATION_CONFIG_FILE)
    if model.startswith("hf://"):
        found = _hub_generation_config(model)
        return _json_defaults(found) if found is not None else {}
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_defaults(path)
    return _json_defaults(path / GENERATION_CONFIG_FILE) if path.is_dir() else {}


def _json_defaults(path: Path) -> SamplingDefaults:
    if not path.is_file():
        if path.parent.is_dir():
            return {}
        raise ValueError(
            f"--generation-config: {path.parent} is not a folder (give auto, vllm or a folder holding "
            f"{GENERATION_CONFIG_FILE})"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON: {e}") from None
    return parse_sampling_keys(raw, str(path))


def _gguf_defaults(path: Path) -> SamplingDefaults:
    from .config import SMOLLM2_FILE

    try:
        found = read_metadata(path, set(GGUF_SAMPLING_KEYS))
    except (GGUFMetadataError, OSError) as e:
        raise ValueError(str(e)) from None
    fields = {GGUF_SAMPLING_KEYS[k]: v for k, v in found.items()}
    top_k = fields.get("top_k")
    if isinstance(top_k, float):  # int or float: the key's type is the converter's choice
        fields["top_k"] = int(top_k)
    if not fields and path.name == SMOLLM2_FILE:
        return SMOLLM2_RECOMMENDED.copy()
    return check_fields(fields, f"{path} (general.sampling.*)")


def _hub_generation_config(model: str) -> Path | None:
    """generation_config.json of an hf:// model, from the local cache or the hub; None when it has none."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    repo, _, revision = model[len("hf://") :].partition("@")
    cached = try_to_load_from_cache(repo, GENERATION_CONFIG_FILE, revision=revision or None)
    if isinstance(cached, str):
        return Path(cached)
    try:
        return Path(hf_hub_download(repo, GENERATION_CONFIG_FILE, revision=revision or None))
    except Exception as e:  # no network, no such file: the model recommends nothing we can read
        log.warning(
            "%s: no %s read (%s: %s); SamplingParams' own defaults apply",
            model,
            GENERATION_CONFIG_FILE,
            type(e).__name__,
            e,
        )
        return None
