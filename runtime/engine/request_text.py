"""RequestText: a frontend's half of an engine-core request's output. The core sends token ids only; this turns each of
its deltas into the one the engine makes in-process (LLMEngine._append_token, _finish): text detokenized
incrementally, cut before the first stop string, the held text flushed at the end."""

from __future__ import annotations

from ..tokenizer import Tokenizer
from .choice_text import ChoiceText
from .input_processor import EngineRequest
from .outputs import CompletionOutput, RequestOutput


class RequestText:
    def __init__(self, tokenizer: Tokenizer, request: EngineRequest, eos_token_ids: frozenset[int]):
        params = request.params
        self.ignore_eos, self.eos_token_ids = params.ignore_eos, eos_token_ids
        self.choices = [
            ChoiceText(tokenizer, request.prompt_ids, params) if params.detokenize else None for _ in range(params.n)
        ]
        self.done = [False] * params.n

    def apply(self, out: RequestOutput) -> list[int]:
        """Fills in `out`'s text, in place, and drops what came after a choice ended here; returns the choices that
        a stop string ended now (the core must stop generating them)."""
        stopped: list[int] = []
        kept = []
        for c in out.outputs:
            if self.done[c.index]:  # ended here by a stop string: the core's later tokens are not part of it
                continue
            text = self.choices[c.index]
            if text is not None and self._add_text(c, text):
                stopped.append(c.index)
            self.done[c.index] = c.finish_reason is not None
            kept.append(c)
        out.outputs = kept
        out.finished = all(self.done)
        return stopped

    def _add_text(self, c: CompletionOutput, text: ChoiceText) -> bool:
        """The choice's new text from its new tokens; True when a stop string ended it."""
        pieces: list[str] = []
        ending = c.finish_reason is not None
        for k, token in enumerate(c.token_ids):
            if ending and k == len(c.token_ids) - 1 and not self._has_text(token, c):
                break
            piece, stopped = text.add(token)
            pieces.append(piece)
            if stopped:  # as the engine does: the output ends with the token that completed the stop string
                c.token_ids = c.token_ids[: k + 1]
                c.logprobs = c.logprobs[: k + 1] if c.logprobs is not None else None
                c.finish_reason, c.stop_reason = "stop", text.stop
                c.text = "".join(pieces)
                return True
        if ending:
            pieces.append(text.finish())
        c.text = "".join(pieces)
        return False

    def _has_text(self, token: int, c: CompletionOutput) -> bool:
        """Whether the token that ended a choice is text: a stop token id or EOS ends it without being added."""
        if c.finish_reason != "stop":
            return True
        if isinstance(c.stop_reason, int):
            return False
        return not (c.stop_reason is None and token in self.eos_token_ids and not self.ignore_eos)
