"""The tokens a response used, read from the replica's own `usage` as the response passes through.

A JSON response carries `usage`; a stream carries it in its last chunk only when the request asked for it
(`stream_options.include_usage`), so the gateway asks for it on every stream it meters and drops that chunk again
when the client had not asked: the client sees the stream it requested, the budget counts exact tokens. A Responses
API stream always ends with the whole response, its usage inside (the server ignores `stream_options` there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_METERED_JSON_BYTES = 16 << 20  # a JSON answer larger than this is relayed without its usage being read


def ask_for_usage(body: dict) -> tuple[dict, bool]:
    """The body to send upstream, and whether the client asked for the usage chunk itself."""
    if not body.get("stream"):
        return body, True
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return body, True
    return {**body, "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}, False


@dataclass
class UsageMeter:
    """Feed it the upstream's bytes in order; it returns the bytes for the client, and keeps the usage it saw."""

    streaming: bool
    client_wants_usage: bool = True
    prompt_tokens: int = 0
    completion_tokens: int = 0
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
        if b'"usage"' in data:
            chunk = self._read_usage(data[5:])
            if chunk is not None and not self.client_wants_usage and chunk.get("choices") == []:
                return b""  # the usage chunk we asked for on the client's behalf
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
        if isinstance(usage, dict):  # chat and completions name the tokens prompt/completion, Responses input/output
            self.prompt_tokens = int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
        return document
