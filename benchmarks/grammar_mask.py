"""Per-token host cost of a structured-output mask, llguidance (what Capstan uses) against outlines-core, on the
served tokenizer: each schema's grammar is compiled, then a valid document is walked token by token, computing
the mask before each token. Prints compile ms and the mean/p99 microseconds per token mask.

    python benchmarks/grammar_mask.py                         # the embedded default model's tokenizer
    python benchmarks/grammar_mask.py --tokenizer /path/to/checkpoint
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from capstan.runtime.config import DEFAULT_MODEL
from capstan.runtime.sampling.grammar import GrammarTokenizer, StructuredOutput, mask_words
from capstan.runtime.tokenizer import Tokenizer

SCHEMAS = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                    "required": ["id", "tags"],
                },
                "kind": {"enum": ["a", "b", "c"]},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["user", "kind", "score"],
        },
        {"user": {"id": 12345, "tags": ["alpha", "beta", "gamma delta"]}, "kind": "b", "score": 0.75},
    ),
    "refs": (
        {
            "$defs": {
                "p": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                }
            },
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}},
            "required": ["a", "b"],
        },
        {"a": {"x": 1.5, "y": -2}, "b": {"x": 0, "y": 3.25}},
    ),
}


def llguidance_costs(grammar: GrammarTokenizer, schema: dict, tokens: list[int]) -> tuple[float, list[float]]:
    started = time.perf_counter()
    constraint = grammar.matcher(StructuredOutput("json", schema))
    compile_ms = 1000 * (time.perf_counter() - started)
    row = np.zeros(mask_words(grammar.vocab_size), np.int32)
    costs = []
    for token in tokens:
        t = time.perf_counter()
        constraint.fill(row)
        costs.append(1e6 * (time.perf_counter() - t))
        assert row[token // 32] >> (token % 32) & 1, "the document's own token is not allowed"
        constraint.accept(token)
    return compile_ms, costs


def outlines_costs(tokenizer: Tokenizer, schema: dict, tokens: list[int]) -> tuple[float, list[float]] | None:
    try:
        import outlines_core
    except ImportError:
        return None
    vocabulary = outlines_core.Vocabulary(
        min(tokenizer.eos_token_ids),
        {
            piece: [i]
            for i in range(tokenizer.vocab_size)
            if i not in tokenizer.eos_token_ids and (piece := tokenizer.decode([i], skip_special_tokens=False))
        },
    )
    started = time.perf_counter()
    # fixed separators, as Capstan's grammars emit them
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_ms = 1000 * (time.perf_counter() - started)
    costs = []
    for token in tokens:
        t = time.perf_counter()
        allowed = guide.get_tokens()
        costs.append(1e6 * (time.perf_counter() - t))
        if token not in allowed:
            return compile_ms, costs  # its vocabulary (decoded pieces) tokenizes differently: stop here
        guide.advance(token)
    return compile_ms, costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=str(DEFAULT_MODEL))
    a = ap.parse_args()
    tokenizer = Tokenizer.from_pretrained(a.tokenizer)
    grammar = GrammarTokenizer(tokenizer, set(tokenizer.eos_token_ids), tokenizer.vocab_size)
    print(f"tokenizer {a.tokenizer}: {tokenizer.vocab_size} tokens")
    print(f"{'schema':>8} {'engine':>13} {'compile ms':>10} {'tokens':>6} {'mean us':>8} {'p99 us':>8}")
    for name, (schema, document) in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(document, separators=(",", ":")), add_special_tokens=False)
        for engine, result in (
            ("llguidance", llguidance_costs(grammar, schema, tokens)),
            ("outlines-core", outlines_costs(tokenizer, schema, tokens)),
        ):
            if result is None:
                continue
            compile_ms, costs = result
            p99 = statistics.quantiles(costs, n=100)[98] if len(costs) > 1 else costs[0]
            print(f"{name:>8} {engine:>13} {compile_ms:10.1f} {len(costs):6d} {statistics.mean(costs):8.1f} {p99:8.1f}")


if __name__ == "__main__":
    main()
