"""Graceful drain on SIGTERM: readiness fails at once, new /v1 requests get 503, in-flight requests (streams
included) finish within the drain timeout, then uvicorn shuts down and the process exits 0.

uvicorn installs its own SIGTERM handler, which would stop the server straight away (and re-raise the
signal on exit, so the process would die of it); `DrainingServer` replaces that handler with the drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from .error_body import draining, error_response

log = logging.getLogger("capstan.server")
GRACE_AFTER_TIMEOUT = 2.0  # seconds for cancelled requests to send their error events before uvicorn stops


class Drain:
    """Whether the server is draining, and which API requests are still in flight."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when every in-flight request finished within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


class DrainMiddleware:
    """Counts /v1 requests until their last body byte is sent; refuses new ones with 503 while draining."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.drain.draining:
            e = draining()
            return await error_response(e.status, e.message, code=e.code, headers=e.headers)(scope, receive, send)
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM drains first; SIGINT (Ctrl-C) stops at once, a second one forcibly."""

    def __init__(
        self, config: uvicorn.Config, drain: Drain, drain_timeout: float, on_timeout=None, on_start=None, on_drain=None
    ):
        super().__init__(config)
        self.drain, self.drain_timeout = drain, drain_timeout
        self.on_timeout = on_timeout  # ends what is still in flight with an error its clients see
        self.on_start = on_start  # on_start(server), on the server's loop: supervision of other processes
        self.on_drain = on_drain  # when a drain starts: other frontends drain too
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.on_start is not None:
            self.on_start(self)
        await super().serve(sockets)

    def fail(self, reason: str) -> None:
        """A part of the server failed (another process of it died): drain as on SIGTERM, then exit 1, so the
        kubelet restarts the pod. Call on the server's loop."""
        log.error("%s: draining, then exiting so that the pod restarts", reason)
        self.exit_code = 1
        if not self.drain.draining:
            self.drain.draining = True
            self._start_drain()

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and the exit code would
        # be the signal's, where Kubernetes expects 0 from a clean drain.
        if sig == signal.SIGTERM and self._loop is not None:
            if not self.drain.draining:  # a second SIGTERM (the pod's, after ours) changes nothing
                self.drain.draining = True  # readiness and new requests see it at once
                self._loop.call_soon_threadsafe(self._start_drain)
        elif self.should_exit:
            self.force_exit = True
        else:
            self.should_exit = True

    def _start_drain(self) -> None:
        # A kept-alive connection would carry its client's next request here after the endpoint is gone, into a
        # 503: idle connections close now, busy ones after their response, and clients reconnect elsewhere.
        for connection in list(self.server_state.connections):
            connection.shutdown()
        if self.on_drain is not None:
            self.on_drain()
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        started = time.monotonic()
        log.info("SIGTERM: draining %d in-flight request(s), up to %.0f s", self.drain.in_flight, self.drain_timeout)
        if await self.drain.wait_idle(self.drain_timeout):
            log.info("drained in %.1f s; shutting down", time.monotonic() - started)
        else:
            log.warning("drain timeout: %d request(s) still in flight end with an error", self.drain.in_flight)
            if self.on_timeout is not None:
                self.on_timeout()
                await self.drain.wait_idle(GRACE_AFTER_TIMEOUT)  # their error events go out
        self.should_exit = True
