"""IncrementalDetokenizer: turns a stream of generated token ids into stable text deltas."""

from __future__ import annotations

from collections.abc import Sequence

from capstan.runtime.tokenizer import Tokenizer

# Decoding bytes that end mid UTF-8 sequence yields this replacement character at the end.
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of generated tokens; all deltas plus flush() equal tokenizer.decode(generated).

    Each step decodes only a short window: tokens from `prefix_offset` (the start of the last emitted
    chunk, kept as context so decoders see the same leading token) to the end, and diffs it against the
    already-emitted text of that window. Text is held back while it ends in an incomplete character
    (or, for byte-fallback tokenizers, in a byte piece).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        # The prompt is not decode context: the stream must equal decode(generated ids) on its own.
        self.num_prompt_tokens = len(prompt_ids)
        self.skip_special_tokens = skip_special_tokens
        self.generated_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: first token of the last emitted chunk
        self._read_offset = 0  # tokens before this have had their text emitted
        self._prefix_text = ""  # decode(generated_ids[prefix_offset:read_offset])

    def _decode_window(self) -> str:
        return self.tokenizer.decode(self.generated_ids[self._prefix_offset :], self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text that became stable (possibly "")."""
        self.generated_ids.append(int(token_id))
        window_text = self._decode_window()
        if window_text.endswith(_INCOMPLETE) or len(window_text) <= len(self._prefix_text):
            return ""
        if self._may_join_next_bytes(self.generated_ids[-1]):
            return ""
        assert window_text.startswith(self._prefix_text), "decoder rewrote text it had already emitted"
        delta = window_text[len(self._prefix_text) :]
        # Only text-bearing chunks move the window, so its first token is one the decoder sees
        # (and strips a leading space from) exactly as it did when decoding the previous window.
        self._prefix_offset, self._read_offset = self._read_offset, len(self.generated_ids)
        self._prefix_text = self.tokenizer.decode(
            self.generated_ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
        )
        self.text += delta
        return delta

    def _may_join_next_bytes(self, token_id: int) -> bool:
        """A run of byte-fallback pieces that turns out invalid UTF-8 decodes to U+FFFD as a whole, even
        its ASCII bytes, so it is final only once a visible non-byte token ends it."""
        if not self.tokenizer.byte_fallback_ids:
            return False
        # Skipped specials and ids past the tokenizer's vocabulary (padded embeddings) decode to nothing.
        invisible = (self.skip_special_tokens and token_id in self.tokenizer.special_token_ids) or (
            self.tokenizer.id_to_piece(token_id) is None
        )
        return invisible or token_id in self.tokenizer.byte_fallback_ids

    def flush(self) -> str:
        """At the end of generation, return any held-back text, incomplete characters included."""
        window_text = self._decode_window()
        assert window_text.startswith(self._prefix_text), "decoder rewrote text it had already emitted"
        delta = window_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.generated_ids)
        self._prefix_text = ""
        self.text += delta
        return delta
