"""OpenAI's error body and the errors any HTTP front of Capstan raises (server and gateway alike); no engine import,
so the gateway serves these without loading JAX. errors.py maps the engine's exceptions onto them."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from .protocol import ErrorDetail, ErrorResponse

RETRY_AFTER_SECONDS = 1  # queue full: the queue drains in about a step's time, so retry soon

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error a route raises on purpose: status, OpenAI type and code, the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    detail = ErrorDetail(message=message, type=_TYPES.get(status, "server_error"), param=param, code=code)
    return ErrorResponse(error=detail).model_dump()


class ErrorJSONResponse(JSONResponse):
    """ASCII-escaped JSON: a message quoting odd text (a lone surrogate) still renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return ErrorJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def draining() -> APIError:
    return APIError(
        503,
        "The server is shutting down and takes no new requests; retry (another replica will answer).",
        code="draining",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )
