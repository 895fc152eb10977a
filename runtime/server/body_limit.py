"""Request bodies over a size limit get 413 before anything parses them (declared or chunked length alike)."""

from __future__ import annotations

from ..limits import DEFAULT_MAX_BODY_BYTES
from .error_body import error_response


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self):
        return error_response(
            413, f"request body is larger than the server's limit of {self.max_bytes} bytes", code="request_too_large"
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._too_large()(scope, receive, send)
            return await self.app(scope, receive, send)
        # No declared length (chunked): read up to the limit here, then replay it to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large()(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later calls wait for http.disconnect as usual
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)
