"""Log-probabilities from the step's outputs as vLLM reports them: per position, the chosen token first (with
its rank), then the top-N alternatives, each with its decoded text."""

from __future__ import annotations

from ..scheduling.scheduler import ScheduledChunk
from ..scheduling.sequence import Sequence
from ..tokenizer import Tokenizer
from .outputs import Logprob, PositionLogprobs
from .step import StepOutputs


def position_logprobs(
    tokenizer: Tokenizer, token: int, logprob: float, rank: int, top_ids, top_lps, n: int
) -> PositionLogprobs:
    entry = {token: Logprob(logprob, rank, tokenizer.decode([token], skip_special_tokens=False))}
    for i in range(n):
        tid = int(top_ids[i])
        if tid not in entry:
            entry[tid] = Logprob(float(top_lps[i]), i + 1, tokenizer.decode([tid], skip_special_tokens=False))
    return entry


def add_prompt_logprobs(tokenizer: Tokenizer, seq: Sequence, c: ScheduledChunk, out: StepOutputs, t0: int) -> None:
    """The logprobs of the prompt tokens this chunk computed (each token's, given the ones before it)."""
    pl, n = out.prompt, seq.params.prompt_logprobs
    assert n is not None and pl is not None, "called for requests that asked for prompt logprobs"
    if c.start == 0:
        seq.prompt_logprobs = [None]  # the first prompt token has no context
    last_prompt = len(seq.prompt_ids) - 1
    for i in range(c.num_tokens):
        pos = c.start + i
        if pos >= last_prompt:
            break
        target = seq.token_ids[pos + 1]
        seq.prompt_logprobs.append(
            position_logprobs(
                tokenizer,
                target,
                float(pl.logprob[t0 + i]),
                int(pl.rank[t0 + i]),
                pl.top_ids[t0 + i],
                pl.top_logprobs[t0 + i],
                n,
            )
        )
    if c.start + c.num_tokens >= len(seq.prompt_ids):
        seq.prompt_logprobs_done = True
