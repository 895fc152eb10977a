"""What the picker reads of a request before it picks: the body (bounded as the server bounds it), its model and
routing key, and the endpoints the Gateway allows (the subset hint). Pure; a request the picker must refuse raises
PickError with the HTTP status the client gets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envoy.config.core.v3 import base_pb2

from ..gateway.proxy import parse_request_body
from ..gateway.routing_policy import DEFAULT_PREFIX_CHARS, routing_key
from ..server.error_body import APIError
from .ext_proc_replies import SUBSET_KEY, SUBSET_NAMESPACE, metadata_value


class PickError(Exception):
    """The request gets this HTTP status and OpenAI error instead of an endpoint."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


@dataclass(frozen=True)
class PickRequest:
    model: str | None  # None: a request without a body (GET /v1/models, /health): any ready replica serves it
    key: str  # routing key: the model and the leading characters of the prompt (routing_policy.routing_key)
    subset: frozenset[str] | None = None  # `ip:port`s the Gateway allows; None: every endpoint of the pool
    path: str = ""  # the HTTP path (`:path`), for KV-event scores: how the replica reads the prompt
    body: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    authorization: str | None = field(default=None, repr=False)  # the client's, for the replica's /tokenize


class RequestBody:
    """The body's chunks as they stream in, refused once they pass `max_bytes` (no more is kept)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._chunks: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            self._chunks.clear()
            raise PickError(
                413,
                f"the request body is over the picker's limit of {self.max_bytes} bytes",
                code="request_too_large",
            )
        self._chunks.append(chunk)

    def bytes(self) -> bytes:
        return b"".join(self._chunks)


def read_request(
    raw: bytes | None,
    metadata: base_pb2.Metadata | None = None,
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    headers: dict[str, str] | None = None,
) -> PickRequest:
    """A request's model, routing key and subset; `raw` None or empty: a request without a body."""
    subset = subset_hint(metadata)
    headers = headers or {}
    path, authorization = headers.get(":path", "").split("?")[0], headers.get("authorization")
    if not raw:
        return PickRequest(None, "", subset, path)
    body = _json_object(raw)
    try:
        return PickRequest(body["model"], routing_key(body, prefix_chars), subset, path, body, authorization)
    except RecursionError:  # within json's depth, too deep to walk
        raise PickError(400, "the request body nests too deeply to parse") from None


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body by the server's own rule (server/json_body.py): what a replica refuses with a 400, so does the
    picker, before a replica is bothered."""
    try:
        return parse_request_body(raw)
    except APIError as error:
        raise PickError(error.status, error.message, code=error.code, param=error.param) from None


def subset_hint(metadata: base_pb2.Metadata | None) -> frozenset[str] | None:
    """`envoy.lb.subset_hint`'s endpoints: a list of `ip:port` (or of comma-separated ones), or one such string."""
    if metadata is None:
        return None
    value = metadata_value(metadata, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    return frozenset(
        part.strip() for item in items if isinstance(item, str) for part in item.split(",") if part.strip()
    )
