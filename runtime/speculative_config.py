"""--speculative-config (vLLM's JSON flag), parsed and checked without JAX (the CLI and config import it)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # K: tokens proposed per step
    prompt_lookup_max: int = 4  # the longest n-gram looked up (tried first)
    prompt_lookup_min: int = 2  # the shortest

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """vLLM's --speculative-config JSON: {"method": "ngram", "num_speculative_tokens": 4, ...}."""
        try:
            fields: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config: not JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config: must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(fields) - known):
            raise ValueError(f"--speculative-config: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        config = cls(**fields)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method {self.method!r} is not supported; supported: "
                             f"{', '.join(METHODS)} (draft models are not yet)")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be at most "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
