"""Request bodies parsed strictly: invalid UTF-8 and nesting too deep for the parser are HTTP 400 with a
message that says so, not FastAPI's generic "error parsing the body" (or a 500 later on)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException, Request
from fastapi.routing import APIRoute


class BodyError(HTTPException):
    """An HTTPException, so FastAPI's body reader passes it through to our error handler."""

    def __init__(self, message: str):
        super().__init__(status_code=400, detail=message)


def parse_json_body(body: bytes) -> Any:
    """The one rule for reading a body (the server's routes and the gateway's): BodyError for what is no JSON text
    at all; json.JSONDecodeError goes on (FastAPI reports it as malformed JSON)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(
            f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start})"
        ) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise BodyError("the request body nests too deeply to parse") from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise BodyError(f"the request body could not be parsed: {e}") from None


class StrictJSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict
