"""Request bodies parsed strictly: invalid UTF-8 and nesting too deep for the parser are HTTP 400 with a
message that says so, not FastAPI's generic "error parsing the body" (or a 500 later on)."""

from __future__ import annotations

import json

from fastapi import HTTPException, Request
from fastapi.routing import APIRoute


class BodyError(HTTPException):
    """An HTTPException, so FastAPI's body reader passes it through to our error handler."""

    def __init__(self, message: str):
        super().__init__(status_code=400, detail=message)


class StrictJSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BodyError(
                    f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start})"
                ) from None
            try:
                self._json = json.loads(text)  # JSONDecodeError goes on: FastAPI reports it as malformed JSON
            except RecursionError:
                raise BodyError("the request body nests too deeply to parse") from None
            except json.JSONDecodeError:
                raise
            except ValueError as e:  # e.g. an integer of more digits than Python converts
                raise BodyError(f"the request body could not be parsed: {e}") from None
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict
