"""Structured outputs: a grammar per sequence (JSON schema, any JSON object, regex, choice, Lark/GBNF), turned
into each step's allowed tokens as a packed bitmask that the jitted step applies on the device.

The grammar engine is llguidance (Rust, no torch): it derives each step's mask lazily from the parser state
(tens of microseconds a token, measured in benchmarks/grammar_mask.py), covers JSON Schema with $ref, anyOf,
enums and numeric bounds, and bounds its own work per token (LLParserLimits), so a hostile schema costs a 400,
not a stuck engine. xgrammar needs torch and transformers; outlines-core compiles a whole automaton per
schema up front."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Literal

import llguidance
import numpy as np

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; `param` is the request field it came from (for errors)."""

    kind: Kind
    spec: Any = None  # a JSON schema (dict or text), a regex, a list of choices, or a grammar's text
    param: str = "structured_outputs"

    def grammar(self) -> str:
        """The llguidance grammar for this constraint."""
        if self.kind in ("json", "json_object"):
            schema = {"type": "object"} if self.kind == "json_object" else self.spec
            if isinstance(schema, str):
                schema = json.loads(schema)  # a JSONDecodeError is the client's 400
            if isinstance(schema, dict) and "x-guidance" not in schema:
                # fixed separators, no free whitespace: even a bad model cannot pad the output forever
                schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
            return llguidance.grammar_from("json_schema", json.dumps(schema))
        if self.kind == "regex":
            return llguidance.grammar_from("regex", self.spec)
        if self.kind == "choice":
            # Lark string literals take JSON's escapes, so any choice text is quoted exactly
            return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in self.spec))
        return llguidance.grammar_from("grammar", self.spec)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarTokenizer:
    """The served tokenizer as llguidance sees it; stop tokens are the ones a finished grammar allows."""

    def __init__(self, tokenizer, stop_token_ids: set[int], vocab_size: int):
        self.vocab_size = vocab_size
        self._build = functools.partial(
            llguidance.LLTokenizer,
            tokenizer.backend_json(),
            n_vocab=vocab_size,
            eos_token=sorted(t for t in stop_token_ids if t < min(vocab_size, tokenizer.vocab_size)),
        )

    @functools.cached_property
    def ll(self) -> llguidance.LLTokenizer:
        return self._build()  # built on first use: servers that never constrain never pay for it

    def check(self, constraint: StructuredOutput) -> str | None:
        """The grammar's error, or None when it compiles (raised to the client as a 400 naming the field)."""
        try:
            grammar = constraint.grammar()
        except (ValueError, TypeError, RuntimeError) as e:
            return str(e)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll)
        return error or None

    def matcher(self, constraint: StructuredOutput) -> TokenConstraint:
        return TokenConstraint(llguidance.LLMatcher(self.ll, constraint.grammar()))


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # threads for the masks of many constrained rows at once


def fill_masks(rows: list[tuple[TokenConstraint, int]], allowed: np.ndarray) -> None:
    """Each constraint's mask into its row of `allowed` [S, words], computed in parallel across rows."""
    assert allowed.dtype == np.int32 and allowed.flags["C_CONTIGUOUS"]
    if len(rows) == 1:
        constraint, r = rows[0]
        constraint.fill(allowed[r])
        return
    _executor().unsafe_compute_mask_ptr(
        [(c._matcher, r) for c, r in rows], allowed.ctypes.data, allowed.shape[1] * 4, allowed.shape[0]
    )


class TokenConstraint:
    """One sequence's parser state: the mask of its next token, advanced by every token it samples."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into `row` (int32 words, bit j of word w: token 32w + j)."""
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> bool:
        """Advances by `token`; True when the grammar is complete (it took one of its stop tokens)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        return self._matcher.is_stopped()

    def copy(self) -> TokenConstraint:
        return TokenConstraint(self._matcher.deep_copy())
