"""The tokenizer a GGUF file carries (vocab, merges or scores, token types, BOS/EOS, chat template), rebuilt with
the `tokenizers` library so that it splits text as llama.cpp's own tokenizer does for the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from .models.config import UnsupportedModelError
from .models.gguf_checkpoint import GGUFFile, field, read_gguf
from .special_tokens import bos_eos_processor

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> the split regexes llama.cpp applies in order before byte-level BPE (llama-vocab.cpp)
PRE_TOKENIZER_PATTERNS = {
    "default": [GPT2_PATTERN],
    "gpt-2": [GPT2_PATTERN],
    "smollm": [r"\p{N}", GPT2_PATTERN],
    "llama-bpe": [
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "qwen2": [
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
}
IGNORE_MERGES = {"llama-bpe"}  # llama.cpp takes a whole pre-token that is in the vocab as is, merges aside
SPM_SPACE = "\u2581"  # SentencePiece's visible space


def gguf_tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """Tokenizer's arguments for the tokenizer in a GGUF file's metadata (Tokenizer.from_pretrained builds it)."""
    reader = read_gguf(str(path))
    kind = field(reader, "tokenizer.ggml.model")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens") or []
    if not tokens:
        raise UnsupportedModelError(f"{path}: GGUF has no tokenizer.ggml.tokens; pass --tokenizer")
    types = field(reader, "tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(reader, tokens, path)
    elif kind == "llama":
        backend = _sentencepiece_bpe(reader, tokens, types)
    else:
        raise UnsupportedModelError(
            f"{path}: GGUF tokenizer.ggml.model={kind!r} is not supported; supported: gpt2, llama"
        )
    # control tokens are special (skipped when decoding); user-defined ones are matched whole, as llama.cpp does
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == gguf.TokenType.USER_DEFINED
        ]
    )
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == gguf.TokenType.CONTROL
        ]
    )

    def token(key: str) -> str | None:
        i = field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = field(reader, "tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
        backend.post_processor = bos_eos_processor(backend, bos if add_bos else None, eos if add_eos else None)
    extra_eos = {field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")} - {None}
    return dict(
        backend=backend,
        name=str(path),
        bos_token=bos,
        eos_token=eos,
        pad_token=token("padding"),
        unk_token=token("unknown"),
        chat_template=field(reader, "tokenizer.chat_template"),
        extra_eos_token_ids=extra_eos,
    )


def _byte_level_bpe(reader: GGUFFile, tokens: list[str], path) -> tokenizers.Tokenizer:
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_PATTERNS:
        raise UnsupportedModelError(
            f"{path}: GGUF tokenizer.ggml.pre={pre!r} is not supported; supported: {', '.join(PRE_TOKENIZER_PATTERNS)}"
        )
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRE_TOKENIZER_PATTERNS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(reader: GGUFFile, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """SentencePiece BPE (Llama 2, Gemma): pieces merge highest score first, unknown bytes fall back to <0xNN>."""
    scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t: s for t, s, ty in zip(tokens, scores, types, strict=True) if ty == gguf.TokenType.NORMAL}
    merges = sorted(
        (
            (piece[:k], piece[k:], score)
            for piece, score in mergeable.items()
            for k in range(1, len(piece))
            if piece[:k] in mergeable and piece[k:] in mergeable
        ),
        key=lambda m: (-m[2], vocab[m[0]], vocab[m[1]]),
    )
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for a, b, _ in merges],
            byte_fallback=True,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
        )
    )
    prefix = field(reader, "tokenizer.ggml.add_space_prefix", True)
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPM_SPACE)] if prefix else []) + [normalizers.Replace(" ", SPM_SPACE)]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return backend
