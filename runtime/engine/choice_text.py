"""ChoiceText: one choice's text as its tokens arrive, detokenized incrementally and cut before the first stop
string. The engine makes it for the offline API and the in-thread server; a frontend makes it for the engine core's
requests (the core then sends token ids only)."""

from __future__ import annotations

from collections.abc import Sequence

from ..sampling.sampling_params import SamplingParams
from ..tokenizer import Tokenizer
from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStringMatcher


class ChoiceText:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stop_matcher = StopStringMatcher(params.stop or [])

    @property
    def stop(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self.stop_matcher.stop

    def add(self, token: int) -> tuple[str, bool]:
        """(text that became final, whether a stop string completed with this token)."""
        return self.stop_matcher.feed(self.detokenizer.add(token))

    def finish(self) -> str:
        """The text held back until the end: incomplete characters, a possible stop string's start."""
        text, stopped = self.stop_matcher.feed(self.detokenizer.flush())
        return text + ("" if stopped else self.stop_matcher.flush())
