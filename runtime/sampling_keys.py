"""generation_config.json's sampling keys as SamplingParams fields, checked against the request limits: for the
model's generation config and for --override-generation-config (which EngineConfig checks when it is made)."""

from __future__ import annotations

from typing import TypedDict, cast

from .sampling.sampling_params import InvalidRequestError, SamplingParams

# generation_config.json key -> SamplingParams field: the keys vLLM takes as request defaults
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",  # OpenAI's; the default model's penalties (generation_config.py)
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
    # llama.cpp's DRY (sampling/dry.py)
    "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base",
    "dry_allowed_length": "dry_allowed_length",
    "dry_penalty_last_n": "dry_penalty_last_n",
    "dry_sequence_breakers": "dry_sequence_breakers",
}


class SamplingDefaults(TypedDict, total=False):
    """The SamplingParams fields a model's generation config (or its override) sets: defaults for requests."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    max_tokens: int
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int
    dry_sequence_breakers: list[str]


def parse_sampling_keys(raw: dict, source: str, strict: bool = False) -> SamplingDefaults:
    """generation_config.json's sampling keys as SamplingParams fields, each checked against the request limits.
    strict: other keys are refused (a typo in a flag must not pass silently); a file's other keys are ignored."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    if strict:
        unknown = sorted(set(raw) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; use {sorted(SAMPLING_KEYS)}")
    fields = {SAMPLING_KEYS[k]: v for k, v in raw.items() if k in SAMPLING_KEYS and v is not None}
    return check_fields(fields, source)


def check_fields(fields: dict, source: str) -> SamplingDefaults:
    """The same limits a request meets (SamplingParams.validate), plus at least one token to generate."""
    try:
        SamplingParams(**fields).validate(vocab_size=1, max_n=1)
    except (InvalidRequestError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from None
    if fields.get("max_tokens") == 0:
        raise ValueError(f"{source}: max_new_tokens must be at least 1, got 0")
    return cast(SamplingDefaults, fields)  # SamplingParams took and checked them above
