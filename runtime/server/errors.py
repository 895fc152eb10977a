"""Every failure leaves the server as OpenAI's error body with OpenAI's status code; no stack trace in a body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.errors import (
    EngineDeadError,
    EngineNotReadyError,
    ModelNotFoundError,
    QueueFullError,
    RequestCancelledError,
    RequestFailedError,
)
from ..sampling.sampling_params import InvalidRequestError
from .error_body import RETRY_AFTER_SECONDS, APIError, ErrorJSONResponse, error_body, error_response

log = logging.getLogger("capstan.server")


def exception_body(exc: BaseException) -> tuple[int, dict]:
    """The status and OpenAI error body for an exception raised while generating (also sent mid-stream)."""
    if isinstance(exc, EngineDeadError):
        return 503, error_body(503, str(exc), code="engine_dead")
    if isinstance(exc, EngineNotReadyError):
        return 503, error_body(503, str(exc), code="not_ready")
    if isinstance(exc, RequestCancelledError):
        return 503, error_body(503, str(exc), code="shutting_down")
    if isinstance(exc, RequestFailedError):
        return 500, error_body(500, str(exc), code="request_failed")
    if isinstance(exc, ModelNotFoundError):
        return 404, error_body(404, str(exc), param="model", code="model_not_found")
    return 500, error_body(500, "internal server error; the server log has the details")


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def queue_full() -> APIError:
    return APIError(
        429,
        "The server is at capacity: too many requests are waiting. Retry shortly.",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def _field_path(loc: tuple, within: bool = False) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'. Where pydantic names the union member it tried
    ('str', 'list[int]'), the path ends there (the field is what the user knows), or with `within` goes on past it
    to the item (('body', 'prompt', 'list[int]', 0) -> 'prompt[0]')."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in str(part):
            if not within:
                break
        else:
            path += f".{part}" if path else str(part)
    return path or None


def _wrong_kind(error: dict) -> bool:
    """An error saying the input is not of a union member's kind (a list where a string goes), not what is wrong
    with a value of the right kind."""
    return error.get("type", "").endswith(("_type", "_parsing"))


def _most_specific(errors: list[dict]) -> dict:
    """The first failing field's error from the union member its input's kind matched (prompt [2**63]: the token
    list's bound, not 'should be a valid string'); when no member matched, the one that got deepest into the input
    (prompt ["a", 3]: 'prompt[1]: should be a valid string')."""
    param = _field_path(tuple(errors[0].get("loc", ())))
    field = [e for e in errors if _field_path(tuple(e.get("loc", ()))) == param]
    right_kind = [e for e in field if not _wrong_kind(e)]
    return right_kind[0] if right_kind else max(field, key=lambda e: len(e.get("loc", ())))


def _message(error: dict) -> str:
    """pydantic's message, with a string's length bound said in characters (on an annotated string it says
    'items')."""
    text, most = error.get("input"), error.get("type") == "too_long"
    if isinstance(text, str) and error.get("type") in ("too_long", "too_short"):
        n = (error.get("ctx") or {}).get("max_length" if most else "min_length")
        if n is not None:
            return f"should have {'at most' if most else 'at least'} {n} character{'s' * (n != 1)}, not {len(text)}"
    return error["msg"]


# Starlette types a handler as taking any Exception; each below is installed for one kind and asserts it.


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = _most_specific(list(exc.errors()))
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    param = _field_path(tuple(first.get("loc", ())))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return error_response(400, "the request body must be a JSON object (send Content-Type: application/json)")
    if first.get("type") == "missing":
        return error_response(400, f"{param}: field required", param=param)
    where = _field_path(tuple(first.get("loc", ())), within=True)
    message = f"{where}: {_message(first)}" if where else _message(first)
    return error_response(400, message, param=param)


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)


async def _on_invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequestError)
    return error_response(400, str(exc), param=exc.param)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _on_queue_full(request: Request, exc: Exception) -> JSONResponse:
    return await _on_api_error(request, queue_full())


async def _on_engine_failure(request: Request, exc: Exception) -> JSONResponse:
    status, body = exception_body(exc)
    return ErrorJSONResponse(body, status_code=status)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error serving %s %s", request.method, request.url.path)
    return error_response(500, "internal server error; the server log has the details")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(InvalidRequestError, _on_invalid_request)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(QueueFullError, _on_queue_full)
    app.add_exception_handler(EngineDeadError, _on_engine_failure)
    app.add_exception_handler(EngineNotReadyError, _on_engine_failure)
    app.add_exception_handler(RequestFailedError, _on_engine_failure)
    app.add_exception_handler(RequestCancelledError, _on_engine_failure)
    app.add_exception_handler(ModelNotFoundError, _on_engine_failure)
    app.add_exception_handler(Exception, _on_unexpected)
