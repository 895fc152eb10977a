"""What a request may cost a client's token budget at most, worked out before it is sent: its prompt tokens plus,
for each choice, its max_tokens (`max_completion_tokens`, `max_output_tokens`), capped at what the model's context
leaves after the prompt, or that whole room where the request names no limit. usage counts a prompt once however
many choices it has; a list of prompts (or of embedding inputs) counts each.

The body's fields are read by the server's own rules (pydantic's, lax: `"stream": "false"` is false, as it is to
the replica), so the gateway never meters a request as something the replica does not run. Prompts are counted by
a replica's own /tokenize (prompt_count.py): what cannot be rendered there (tools, Responses items other than
messages) is bounded by its UTF-8 bytes, as a byte-level tokenizer never makes more tokens than bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..server.error_body import APIError

GENERATING_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
TEMPLATE_MARGIN = 16  # tokens a Responses item's rendering may add beyond its bytes (role markers)


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Fields):
    include_usage: bool = False


class GenerationFields(_Fields):
    """The fields of a generating request that decide its cost and how its usage comes back, typed as the server
    types them (runtime/server/protocol.py); the server's bounds are its own to check."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    max_output_tokens: int | None = Field(None, ge=0)

    def completion_limit(self, path: str) -> int | None:
        """The most tokens one choice may generate, as the route reads it; None: up to the end of the context."""
        if path == "/v1/responses":
            return self.max_output_tokens
        if path == "/v1/chat/completions" and self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def choices(self, path: str) -> int:
        return 1 if path == "/v1/responses" else self.n


def generation_fields(path: str, body: dict) -> GenerationFields | None:
    """The body's generation fields (None for routes that generate nothing); a 400 naming the field when its type is
    one the server refuses too."""
    if path not in GENERATING_ROUTES:
        return None
    try:
        return GenerationFields.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", param=where) from None


@dataclass
class PromptPiece:
    """One prompt as usage counts it: token ids counted here, or a /tokenize body for a replica to count, plus a
    bound on what the route renders that /tokenize does not see."""

    tokens: int | None = None
    tokenize: dict[str, Any] | None = None
    extra: int = 0


def _bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode()) if value is not None else 0


def _text_or_ids(value: Any) -> list[PromptPiece]:
    """A completions prompt or an embeddings input: a string, strings, one token list or several."""
    if isinstance(value, str):
        return [PromptPiece(tokenize={"prompt": value})]
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [PromptPiece(tokens=len(value))]
    if isinstance(value, list):
        return [
            PromptPiece(tokens=len(v)) if isinstance(v, list) else PromptPiece(tokenize={"prompt": v})
            for v in value
            if isinstance(v, str | list)
        ]
    return []  # a type the server refuses: it runs nothing


def _message_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _responses_piece(body: dict) -> PromptPiece:
    """The Responses API's input as chat messages where it is messages; other items by their bytes."""
    messages, extra = [], _bytes(body.get("tools")) + _bytes(body.get("text"))
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and item.get("role") in ("user", "assistant", "system", "developer"):
            messages.append({"role": item["role"], "content": _message_text(item.get("content"))})
        else:  # a function call or its output: rendered from its fields
            extra += _bytes(item) + TEMPLATE_MARGIN
    if not messages:
        return PromptPiece(tokens=0, extra=extra)
    return PromptPiece(tokenize={"messages": messages}, extra=extra + TEMPLATE_MARGIN * len(messages))


def prompt_pieces(path: str, body: dict) -> list[PromptPiece]:
    """The prompts of a request, one per prompt that usage counts; none for routes that charge no tokens."""
    if path == "/v1/completions":
        return _text_or_ids(body.get("prompt"))
    if path == "/v1/embeddings":
        return _text_or_ids(body.get("input"))
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return []
        tokenize = {"messages": messages, "add_generation_prompt": body.get("add_generation_prompt", True)}
        if body.get("chat_template_kwargs") is not None:
            tokenize["chat_template_kwargs"] = body["chat_template_kwargs"]
        return [PromptPiece(tokenize=tokenize, extra=_bytes(body.get("tools")) + _bytes(body.get("response_format")))]
    if path == "/v1/responses":
        return [_responses_piece(body)]
    return []


def worst_case(path: str, fields: GenerationFields | None, prompts: list[int], max_model_len: int) -> int:
    """The most tokens usage can report for these prompts: each prompt once, and each of its choices up to the
    request's limit or the context's end."""
    if fields is None:  # embeddings: the inputs are the whole cost
        return sum(prompts)
    limit, choices = fields.completion_limit(path), fields.choices(path)
    total = 0
    for prompt in prompts:
        room = max(0, max_model_len - prompt)
        total += prompt + choices * (room if limit is None else min(limit, room))
    return total
