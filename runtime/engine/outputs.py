"""What the engine returns, in vLLM's shape: RequestOutput holding one CompletionOutput per choice."""

from __future__ import annotations

import dataclasses

from ..sampling.logprobs import PositionLogprobs


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """Cumulative in LLM.generate(); in AsyncLLM.generate() each yield carries only the new text/tokens (a delta)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta that says what `first` then `later` said (a consumer behind the engine takes one chunk, not many, as
    vLLM's output collector does): each choice's text, tokens and logprobs joined, its end taken from `later`."""
    choices = {c.index: dataclasses.replace(c, token_ids=list(c.token_ids)) for c in first.outputs}
    for c in later.outputs:
        have = choices.get(c.index)
        if have is None:
            choices[c.index] = dataclasses.replace(c, token_ids=list(c.token_ids))
            continue
        have.text += c.text
        have.token_ids += c.token_ids
        if c.logprobs is not None:
            have.logprobs = (have.logprobs or []) + c.logprobs
        if c.finish_reason is not None:
            have.finish_reason, have.stop_reason = c.finish_reason, c.stop_reason
    return dataclasses.replace(
        first,
        outputs=sorted(choices.values(), key=lambda c: c.index),
        finished=later.finished,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs,
        num_cached_tokens=max(first.num_cached_tokens, later.num_cached_tokens),
    )


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]  # unit length (L2-normalised)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """One embedded prompt, in vLLM's shape (LLM.embed returns one per prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
