"""SamplingParams in vLLM's shape; validate() turns bad values into errors that name the field and the limit."""
from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_LOGIT_BIAS = 300  # entries; OpenAI documents no cap, vLLM none: we cap to bound the device array
MAX_STOP_STRINGS = 16


class InvalidRequestError(ValueError):
    """A request the engine refuses before queueing; `param` names the offending field (OpenAI's error param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the end of the context
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token (0: only the chosen token's)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (benchmarks; clients that detokenize themselves)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self, *, vocab_size: int, max_n: int) -> None:
        def bad(param: str, message: str):
            raise InvalidRequestError(f"{param}: {message}", param)

        if not 1 <= self.n <= max_n:
            bad("n", f"must be between 1 and {max_n}, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            bad("temperature", f"must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be between 0 and 1, got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be between -2 and 2, got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if not 0 <= int(token) < vocab_size:
                    bad("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})")
                if not -100.0 <= bias <= 100.0:
                    bad("logit_bias", f"bias for token {token} must be between -100 and 100, got {bias}")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings need detokenize=true")
        if self.stop and len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if self.stop and any(not s for s in self.stop):
            bad("stop", "stop strings must not be empty")
        for token in self.stop_token_ids or []:
            if not 0 <= token < vocab_size:
                bad("stop_token_ids", f"token id {token} is outside the vocabulary [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                bad(name, f"must be between 0 and {MAX_LOGPROBS}, got {value}")
        if self.seed is not None and not -(2 ** 63) <= self.seed < 2 ** 64:
            bad("seed", "must fit in 64 bits")
