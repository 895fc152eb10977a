"""API keys: from --api-key (repeatable), --api-key-file (one key a line, e.g. a mounted Secret) and the
CAPSTAN_API_KEY env var (comma-separated). With any configured, every /v1 call needs `Authorization: Bearer`."""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from fastapi import Request

from .error_body import APIError, error_response

ENV_VAR = "CAPSTAN_API_KEY"


def load_api_keys(
    keys: list[str] | None = None, key_file: str | None = None, env: Mapping[str, str] | None = None
) -> list[str]:
    environ = os.environ if env is None else env
    found = list(keys or [])
    if key_file:
        path = Path(key_file)
        if not path.is_file():
            raise ValueError(f"--api-key-file {key_file}: no such file")
        found += path.read_text(encoding="utf-8").splitlines()
    found += environ.get(ENV_VAR, "").split(",")
    unique = dict.fromkeys(k.strip() for k in found)  # keeps the order, drops repeats
    return [k for k in unique if k]


class APIKeyCheck:
    """Passes when no keys are configured or the bearer token matches one of them; raises APIError(401) else."""

    def __init__(self, keys: list[str]):
        self._keys = [k.encode() for k in keys]

    async def __call__(self, request: Request) -> None:
        if not self._keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(
                401, "missing API key: send the header `Authorization: Bearer <key>`", code="invalid_api_key"
            )
        given = token.strip().encode()
        # Compare against every key, without stopping early, so timing says nothing about which one matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")


# Outside /v1 but keyed too (vLLM leaves them open): they run the tokenizer and chat template on request data,
# or (/tokenizer_info) describe the served model as /v1/models does.
KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class APIKeyMiddleware:
    """Checks the key of every /v1 request before anything reads its body, as OpenAI does: a request without
    a valid key gets 401 even when its JSON is malformed. Plain ASGI, so streaming and disconnects pass through."""

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.check = APIKeyCheck(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in KEYED_PATHS):
            try:
                await self.check(Request(scope))
            except APIError as e:
                await error_response(e.status, e.message, code=e.code)(scope, receive, send)
                return
        await self.app(scope, receive, send)
