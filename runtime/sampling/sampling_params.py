"""SamplingParams in vLLM's shape; validate() turns bad values into errors that name the field and the limit."""

from __future__ import annotations

import dataclasses
import math
import numbers

from ..limits import (
    DRY_MAX_MATCH,
    INT32_MAX,
    INT64_MIN,
    LOGIT_BIAS_RANGE,
    MAX_DRY_BASE,
    MAX_DRY_BREAKER_CHARS,
    MAX_DRY_BREAKERS,
    MAX_DRY_MULTIPLIER,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS_IN_ENGINE,
    MAX_TEMPERATURE,
    PENALTY_RANGE,
    UINT64_MAX,
)
from .grammar import StructuredOutput

DEFAULT_BREAKERS = ("\n", ":", '"', "*")  # DRY's sequence breakers: llama.cpp's and koboldcpp's
__all__ = ["InvalidRequestError", "SamplingParams", "MAX_LOGIT_BIAS", "MAX_LOGPROBS"]


class InvalidRequestError(ValueError):
    """A request the engine refuses before queueing; `param` names the offending field (OpenAI's error param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the end of the context; 0: only the prompt (with prompt_logprobs)
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # DRY (sampling/dry.py), llama.cpp's fields and defaults; a multiplier of 0 turns it off
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context (the last DRY_WINDOW tokens); 0: off
    dry_sequence_breakers: list[str] | None = None  # None: DEFAULT_BREAKERS
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token (0: only the chosen token's)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (benchmarks; clients that detokenize themselves)
    structured: StructuredOutput | None = None  # the output must match this grammar (structured outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.uses_dry)

    @property
    def uses_dry(self) -> bool:
        return bool(self.dry_multiplier) and self.dry_penalty_last_n != 0

    @property
    def breakers(self) -> tuple[str, ...]:
        return DEFAULT_BREAKERS if self.dry_sequence_breakers is None else tuple(self.dry_sequence_breakers)

    def validate(self, *, vocab_size: int, max_n: int, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Every field within its limit (runtime/limits.py), before anything is built from it."""

        def bad(param: str, message: str):
            raise InvalidRequestError(f"{param}: {message}", param)

        def integer(param: str, low: int, high: int, what: str) -> None:
            value = getattr(self, param)
            if not _is_int(value) or not low <= value <= high:
                bad(param, f"must be {what}, got {value!r}")

        def number(param: str, low: float, high: float, what: str, low_open: bool = False) -> None:
            value = getattr(self, param)
            if not _is_number(value) or not low <= value <= high or low_open and value == low:
                bad(param, f"must be {what}, got {value!r}")

        integer("n", 1, max_n, f"between 1 and {max_n} (the server's max_num_seqs)")
        if self.max_tokens is not None:
            integer("max_tokens", 0, INT32_MAX, f"between 0 and {INT32_MAX}")
        integer(
            "min_tokens",
            0,
            self.max_tokens if self.max_tokens is not None else INT32_MAX,
            f"between 0 and max_tokens ({self.max_tokens})",
        )
        number("temperature", 0.0, MAX_TEMPERATURE, f"between 0 and {MAX_TEMPERATURE:g}")
        number("top_p", 0.0, 1.0, "in (0, 1]", low_open=True)
        integer("top_k", -1, INT32_MAX, f"-1 (off), 0 (off) or a positive integer up to {INT32_MAX}")
        number("min_p", 0.0, 1.0, "between 0 and 1")
        for name in ("presence_penalty", "frequency_penalty"):
            number(name, -PENALTY_RANGE, PENALTY_RANGE, f"between {-PENALTY_RANGE:g} and {PENALTY_RANGE:g}")
        number("repetition_penalty", 0.0, MAX_REPETITION_PENALTY, f"in (0, {MAX_REPETITION_PENALTY:g}]", low_open=True)
        number("dry_multiplier", 0.0, MAX_DRY_MULTIPLIER, f"between 0 (off) and {MAX_DRY_MULTIPLIER:g}")
        number("dry_base", 1.0, MAX_DRY_BASE, f"between 1 and {MAX_DRY_BASE:g}")
        integer("dry_allowed_length", 0, DRY_MAX_MATCH, f"between 0 and {DRY_MAX_MATCH}")
        integer("dry_penalty_last_n", -1, INT32_MAX, f"-1 (the whole context), 0 (off) or up to {INT32_MAX}")
        breakers = self.dry_sequence_breakers
        if breakers is not None:
            if not isinstance(breakers, list | tuple) or len(breakers) > MAX_DRY_BREAKERS:
                bad("dry_sequence_breakers", f"must be a list of at most {MAX_DRY_BREAKERS} strings")
            for s in breakers:
                if not isinstance(s, str) or not s or len(s) > MAX_DRY_BREAKER_CHARS:
                    bad("dry_sequence_breakers", f"each breaker must have 1 to {MAX_DRY_BREAKER_CHARS} characters")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or not 0 <= token < vocab_size:
                    bad("logit_bias", f"token id {token!r} is outside the vocabulary [0, {vocab_size})")
                if not _is_number(bias) or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                    bad(
                        "logit_bias",
                        f"bias for token {token} must be between {-LOGIT_BIAS_RANGE:g} and "
                        f"{LOGIT_BIAS_RANGE:g}, got {bias!r}",
                    )
        if self.stop:
            if not self.detokenize:
                bad("stop", "stop strings need detokenize=true")
            if len(self.stop) > MAX_STOP_STRINGS:
                bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
            for s in self.stop:
                if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                    bad("stop", f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
        if self.stop_token_ids:
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS_IN_ENGINE:
                bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS_IN_ENGINE} ids, got {len(self.stop_token_ids)}")
            for token in self.stop_token_ids:
                if not _is_int(token) or not 0 <= token < vocab_size:
                    bad("stop_token_ids", f"token id {token!r} is outside the vocabulary [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, 0, max_logprobs, f"between 0 and {max_logprobs} (the server's max_logprobs)")
        if self.seed is not None:
            integer("seed", INT64_MIN, UINT64_MAX, f"an integer in [{INT64_MIN}, {UINT64_MAX}] (64 bits)")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """Finite, and not a bool (NaN fails every range check, but say so plainly)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
