"""Bounds on an HTTP request's head, for every uvicorn Capstan runs (`capstan serve`'s frontends, the gateway): at
most MAX_HEADER_BYTES of request line and headers and MAX_HEADER_COUNT header fields (431 past either, as nginx
answers), sent within HEADER_TIMEOUT_S of the connection's or the request's start (408 past it, then closed).

uvicorn's httptools protocol bounds none of these: the parser keeps a header line growing as long as bytes come, and
a connection that never finishes its head stays open. HeaderLimitedProtocol counts the head's bytes as they arrive
(each read is at most 256 KiB, so no more than that is ever held past the limit) and its fields as they parse."""

from __future__ import annotations

import asyncio
import json
import logging

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..limits import HEADER_TIMEOUT_S, MAX_HEADER_BYTES, MAX_HEADER_COUNT
from .error_body import error_body

log = logging.getLogger("capstan.server")
LINGER_S, LINGER_BYTES = 2.0, 1 << 20  # after a refusal: how long and how much of the rest is read and dropped
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class HeadRefused(Exception):
    """Raised inside the parser's callbacks to stop it (httptools raises its own error in its place)."""


class HeaderLimitedProtocol(HttpToolsProtocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes, self._head_parsed, self._head_fields, self._head_done = 0, 0, 0, False
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None
        self._refused, self._lingered = False, 0
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # what the client still sends after the answer: read and dropped, up to LINGER_BYTES
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        if not self._head_done:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)  # uvicorn's own handling, but for what this class refuses
        except httptools.HttpParserError:
            if self._refusal is not None:
                return self._refuse(*self._refusal)
            return self._parser_error()
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if not self._head_done and self._head_bytes > MAX_HEADER_BYTES:
            self._refuse(431, f"the request line and headers exceed {MAX_HEADER_BYTES} bytes")

    def _parser_error(self) -> None:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)

    def on_message_begin(self) -> None:
        if self._head_done:  # the next request on a kept-alive connection: its head is counted afresh
            self._head_bytes, self._head_parsed, self._head_fields, self._head_done = 0, 0, 0, False
            self._start_head_timer()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._grow_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += 1
        if self._head_fields > MAX_HEADER_COUNT:
            self._refusal = (431, f"the request has more than {MAX_HEADER_COUNT} header fields")
            raise HeadRefused(self._refusal[1])
        self._grow_head(len(name) + len(value) + 4)  # "name: value\r\n"
        super().on_header(name, value)

    def _grow_head(self, size: int) -> None:
        """The parsed head's size (a read that brings a whole head is refused here; one that does not, after it)."""
        self._head_parsed += size
        if self._head_parsed > MAX_HEADER_BYTES:
            self._refusal = (431, f"the request line and headers exceed {MAX_HEADER_BYTES} bytes")
            raise HeadRefused(self._refusal[1])

    def on_headers_complete(self) -> None:
        self._head_done = True
        self._cancel_head_timer()
        super().on_headers_complete()

    def _start_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = asyncio.get_running_loop().call_later(HEADER_TIMEOUT_S, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()  # type: ignore[union-attr]
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._head_done and not self.transport.is_closing():
            self._refuse(408, f"the request's headers did not arrive within {HEADER_TIMEOUT_S:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answers with OpenAI's error body and closes the connection. Closed at once, a socket with unread bytes would
        be reset and the client lose the answer, so the rest of the request is read and dropped for a moment first."""
        self._cancel_head_timer()
        self._refused = True
        code = "request_header_fields_too_large" if status == 431 else "request_timeout"
        body = json.dumps(error_body(status, message, code=code)).encode()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning("%s: %d, %s", client, status, message)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, REASONS[status], len(body))
            + body
        )
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
