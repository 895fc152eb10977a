"""--speculative-config (vLLM's JSON flag), parsed and checked without JAX (the CLI and config import it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
NGRAM_FIELDS = ("prompt_lookup_max", "prompt_lookup_min")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) or "draft_model" (a smaller model with the same vocabulary)
    num_speculative_tokens: int = 4  # K: tokens proposed per step
    prompt_lookup_max: int = 4  # ngram: the longest n-gram looked up (tried first)
    prompt_lookup_min: int = 2  # ngram: the shortest
    model: str | None = None  # draft_model: checkpoint folder, .gguf file or hf://org/name[@revision]
    # vLLM's: no proposals while this many sequences or more are running (where a batch's decode step is no longer
    # bound by reading the weights, verifying costs more than it saves: benchmarks/RESULTS.md)
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """vLLM's --speculative-config JSON: {"method": "ngram", "num_speculative_tokens": 4, ...} or
        {"method": "draft_model", "model": "path/to/draft", "num_speculative_tokens": 4}."""
        try:
            fields: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config: not JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config: must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(fields) - known):
            raise ValueError(
                f"--speculative-config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "model" in fields and "method" not in fields:  # as vLLM: a model alone means a draft model
            fields["method"] = "draft_model"
        if fields.get("method") == "draft_model" and (given := [f for f in NGRAM_FIELDS if f in fields]):
            raise ValueError(f"--speculative-config: {', '.join(given)}: for method 'ngram' only, not 'draft_model'")
        config = cls(**fields)
        config.validate()
        config.check_draft_exists()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"--speculative-config: method {self.method!r} is not supported; supported: {', '.join(METHODS)}"
            )
        for name in ("num_speculative_tokens", *NGRAM_FIELDS):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 2):
            raise ValueError(
                f"--speculative-config: disable_by_batch_size must be an integer of at least 2 (or null), got {size!r}"
            )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--speculative-config: num_speculative_tokens must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError(
                '--speculative-config: method "draft_model" needs "model": the draft checkpoint '
                "(folder, .gguf file or hf://org/name) with the target's vocabulary"
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f'--speculative-config: model applies to method "draft_model"; method is {self.method!r}')

    def check_draft_exists(self) -> None:
        """A local draft checkpoint must be there (hf:// ones are fetched when the engine loads them)."""
        if self.method != "draft_model":
            return
        assert self.model is not None, "validate() refuses draft_model without a model"
        if self.model.startswith("hf://"):
            return
        path = Path(self.model)
        if not (path.is_dir() or path.suffix == ".gguf" and path.is_file()):
            raise ValueError(
                f"--speculative-config: model {self.model!r}: no such checkpoint folder or .gguf file "
                "(or use hf://org/name)"
            )
