"""Tokenizer: a Hugging Face checkpoint's tokenizer and chat template, without transformers.

Encoding, decoding and chat rendering match transformers 5 exactly for the same checkpoint folder.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .special_tokens import bos_eos_processor

# Tokens that end an assistant turn in the common chat formats (ChatML, Llama 3, Gemma, Phi); the ones that
# are special tokens of the served tokenizer stop a chat turn even when the checkpoint's eos is another token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: str | dict | None) -> str | None:
    # tokenizer_config.json may store special tokens as serialised AddedToken dicts.
    return token.get("content") if isinstance(token, dict) else token


def _as_ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _default_template(chat_template: str | list[dict] | None) -> str | None:
    """tokenizer_config.json holds one template, or a list of named ones of which 'default' is used."""
    if not isinstance(chat_template, list):
        return chat_template
    named = {t["name"]: t["template"] for t in chat_template}
    return named.get("default")


def _byte_fallback_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids of the <0xNN> pieces a SentencePiece-style model spells unknown characters with."""
    if not getattr(backend.model, "byte_fallback", False):
        return frozenset()
    ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(i for i in ids if i is not None)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers overrides jinja's tojson, which would HTML-escape and sort keys.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we render it as-is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _normalise_content(message: dict) -> dict:
    """OpenAI-style content parts [{"type": "text", "text": ...}] become one string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    kinds = {part.get("type") for part in content}
    if kinds - {"text"}:
        unsupported = sorted(kinds - {"text"})
        raise ValueError(f"message content parts of type {unsupported} are not supported; send text parts only")
    return {**message, "content": "".join(part["text"] for part in content)}


class Tokenizer:
    """Encodes, decodes and renders chats for one checkpoint."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        name: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ):
        self._backend = backend
        self.name = name
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.chat_template = chat_template
        self._compiled_template = _chat_environment().from_string(chat_template) if chat_template else None
        self.eos_token_ids = frozenset(_as_ids(self.eos_token_id) | set(extra_eos_token_ids))
        self.byte_fallback_ids = _byte_fallback_ids(backend)
        self.special_token_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if path.suffix == ".gguf" and path.is_file():  # the tokenizer lives in the GGUF's metadata
            from .gguf_tokenizer import gguf_tokenizer_fields  # lazy: gguf and its reader only for .gguf files

            return cls(**gguf_tokenizer_fields(path))
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"checkpoint at {path} has no tokenizer.json; only fast (tokenizers) checkpoints are supported"
            )
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        if "add_bos_token" in config or "add_eos_token" in config:
            bos = special["bos_token"] if config.get("add_bos_token") else None
            eos = special["eos_token"] if config.get("add_eos_token") else None
            backend.post_processor = bos_eos_processor(backend, bos, eos)
        template_file = path / "chat_template.jinja"
        # Like transformers 5, a chat_template.jinja file wins over tokenizer_config.json.
        template: str | None
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = _default_template(config.get("chat_template"))
        model_config = _read_json(path / "config.json")
        extra_eos = (
            _as_ids(_read_json(path / "generation_config.json").get("eos_token_id"))
            | _as_ids(model_config.get("eos_token_id"))
            | _as_ids(model_config.get("text_config", {}).get("eos_token_id"))
        )
        return cls(backend, name=str(path), chat_template=template, extra_eos_token_ids=extra_eos, **special)

    # --- vocabulary ---

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def end_of_turn_ids(self) -> list[int]:
        """EOS ids plus the end-of-turn special tokens of the common chat formats that this tokenizer has."""
        ids = {i for t in END_OF_TURN_TOKENS if (i := self.token_to_id(t)) is not None} & set(self.special_token_ids)
        return sorted(ids | set(self.eos_token_ids))

    def backend_json(self) -> str:
        return self._backend.to_str()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers (its vocabulary entry is at least as long)."""
        return max((len(piece) for piece in self._backend.get_vocab(with_added_tokens=True)), default=1)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(int(i)) for i in ids]

    def id_to_piece(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    # --- text <-> ids ---

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # --- chat ---

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        if self._compiled_template is None:
            raise ValueError(
                f"checkpoint at {self.name} has no chat template (no chat_template.jinja and no chat_template "
                "in tokenizer_config.json); send a completion request with a raw prompt instead"
            )
        variables = {"tools": None, "documents": None, **extra}
        text = self._compiled_template.render(
            messages=[_normalise_content(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            unk_token=self.unk_token,
            **variables,
        )
        # The template already wrote the special tokens (e.g. bos); transformers 5 does not add them again.
        return self.encode(text, add_special_tokens=False) if tokenize else text
