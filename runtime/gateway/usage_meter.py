"""The tokens a response used, read from the replica's own `usage` as the response passes through.

A JSON response carries `usage`; a stream carries it in its last chunk only when the request asked for it
(`stream_options.include_usage`), so the gateway asks for it on every stream it meters and drops that chunk again
when the client had not asked: the client sees the stream it requested, the budget counts exact tokens. A Responses
API stream always ends with the whole response, its usage inside (the server ignores `stream_options` there).
Whether a response streams is read from its content type, not guessed from the request.

A stream that ends without its usage (the client hung up, the replica broke off) is charged what it had delivered:
one token per byte of text relayed (at least one an event), an upper bound for byte-level tokenizers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .request_cost import GenerationFields

RESPONSE_ENDS = ("response.completed", "response.failed", "response.incomplete")  # a Responses stream's last events
MAX_METERED_JSON_BYTES = 16 << 20  # a JSON answer larger than this is relayed without its usage being read


def ask_for_usage(body: dict, fields: GenerationFields | None) -> tuple[dict, bool]:
    """The body to send upstream, and whether the client asked for the usage chunk itself (`fields`: the body's
    stream fields as the server reads them)."""
    if fields is None or not fields.stream:
        return body, True
    if fields.stream_options is not None and fields.stream_options.include_usage:
        return body, True
    options = body.get("stream_options")
    return {**body, "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}, False


@dataclass
class UsageMeter:
    """Feed it the upstream's bytes in order; it returns the bytes for the client, and keeps the usage it saw."""

    streaming: bool = False
    client_wants_usage: bool = True
    prompt_tokens: int = 0
    completion_tokens: int = 0
    saw_usage: bool = False
    delivered: int = 0  # a stream's generated text relayed so far, in tokens at most (module docstring)
    finished: bool = False  # a stream's last event ([DONE], or a Responses stream's final response) went through
    _pending: bytes = b""
    _json_too_large: bool = False

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def feed(self, chunk: bytes) -> bytes:
        if not self.streaming:
            if not self._json_too_large:
                self._pending += chunk
                if len(self._pending) > MAX_METERED_JSON_BYTES:
                    self._json_too_large, self._pending = True, b""
            return chunk
        self._pending += chunk
        events, _, self._pending = self._pending.rpartition(b"\n\n")
        if not events:
            return b""
        return b"".join(self._event(event) for event in events.split(b"\n\n"))

    def close(self) -> bytes:
        """The end of the response: what is left for the client."""
        if not self.streaming:
            self._read_usage(self._pending)
            self._pending = b""
            return b""
        rest, self._pending = self._pending, b""
        return self._event(rest, last=True) if rest.strip() else rest

    def _event(self, event: bytes, last: bool = False) -> bytes:
        # an event's lines: its data, after an `event:` line where the stream names its events (Responses API)
        data = next((line for line in event.strip().split(b"\n") if line.startswith(b"data:")), b"")
        payload = data[5:].strip()
        self.finished = self.finished or payload == b"[DONE]"
        if payload and payload != b"[DONE]":
            document = self._read_usage(payload)
            if document is not None and document.get("choices") == [] and isinstance(document.get("usage"), dict):
                if not self.client_wants_usage:
                    return b""  # the usage chunk we asked for on the client's behalf
            elif document is not None:
                generated = _generated_bytes(document)
                self.delivered += generated or (1 if document.get("choices") else 0)
        return event if last else event + b"\n\n"

    def _read_usage(self, raw: bytes) -> dict | None:
        try:
            document = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(document, dict):
            return None
        usage = document.get("usage")
        if isinstance(document.get("response"), dict):  # a Responses API stream's last event holds the response
            usage = document["response"].get("usage")
            self.finished = self.finished or document.get("type") in RESPONSE_ENDS
        if isinstance(usage, dict):  # chat and completions name the tokens prompt/completion, Responses input/output
            self.saw_usage = True
            self.prompt_tokens = int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
        return document


def _generated_bytes(event: dict) -> int:
    """UTF-8 bytes of the generated text in one stream event: a choice's text, content or tool-call arguments, or a
    Responses delta."""
    texts: list[Any] = [event.get("delta")]
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = {}
        texts += [choice.get("text"), delta.get("content"), delta.get("reasoning_content")]
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                texts.append(call["function"].get("arguments"))
    return sum(len(t.encode()) for t in texts if isinstance(t, str))
