"""Log-probabilities as vLLM reports them: per position, the chosen token first (with its rank), then the top-N
alternatives, each with its decoded text; from a step's sampled tokens or its prompt outputs."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the frontend reads these results without importing JAX: it starts faster beside the core)
    from ..tokenizer import Tokenizer
    from .sampler import PromptLogprobs


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


# One position's log-probabilities: the chosen token first, then the top-N alternatives.
PositionLogprobs = dict[int, Logprob]


def position_logprobs(
    tokenizer: Tokenizer, token: int, logprob: float, rank: int, top_ids, top_lps, n: int
) -> PositionLogprobs:
    entry = {token: Logprob(logprob, rank, tokenizer.decode([token], skip_special_tokens=False))}
    for i in range(n):
        tid = int(top_ids[i])
        if tid not in entry:
            entry[tid] = Logprob(float(top_lps[i]), i + 1, tokenizer.decode([tid], skip_special_tokens=False))
    return entry


def prompt_logprobs(
    tokenizer: Tokenizer, targets: list[int], prompt: PromptLogprobs, t0: int, n: int
) -> list[PositionLogprobs]:
    """The logprobs of prompt tokens `targets`, each given the ones before it: row t0 + i of a step's prompt outputs
    predicted targets[i]; n alternatives each."""
    return [
        position_logprobs(
            tokenizer,
            target,
            float(prompt.logprob[t0 + i]),
            int(prompt.rank[t0 + i]),
            prompt.top_ids[t0 + i],
            prompt.top_logprobs[t0 + i],
            n,
        )
        for i, target in enumerate(targets)
    ]
