"""AsyncLLM: the engine on its own thread, with an asyncio face for the server.

One engine thread owns all engine state and runs a plain loop: take new requests and aborts from a queue,
step, hand each request's deltas to its asyncio queue. The server's event loop never waits on the device."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from ..config import EngineConfig
from .engine import EngineStats, LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("capstan.engine")


class QueueFullError(Exception):
    """More requests are waiting than max_waiting allows (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can make progress."""


class AsyncLLM:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="capstan-engine", daemon=True)
        self._thread.start()

    # ---- state for probes and metrics ---------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.is_alive()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self._stats  # refreshed by the engine thread after every step

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    # ---- requests -----------------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Validates (raising InvalidRequestError or QueueFullError), then yields delta RequestOutputs."""
        if not self.is_alive():
            raise EngineDeadError("the engine thread has stopped")
        seqs = self.engine.prepare(request_id, prompt, params)
        free_slots = max(0, self.config.max_num_seqs - self._stats.running)
        if self._stats.waiting + self._commands.qsize() - free_slots >= self.config.max_waiting:
            raise QueueFullError(f"{self.config.max_waiting} requests are already waiting")
        if request_id in self._streams:
            from .sampling_params import InvalidRequestError

            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", seqs))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (client disconnect, cancellation): free the pages now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    # ---- the engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.config.warmup:
                self.engine.warmup()
            self._ready.set()
            while not self._stop.is_set():
                self._take_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                self._stats = self.engine.stats()
        except BaseException as e:  # a device or engine fault: fail every request, stop (liveness turns false)
            log.exception("engine loop failed")
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"engine failed: {type(e).__name__}"))

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = command
            if kind == "add":
                if arg[0].request_id in self._streams:  # its consumer may already have gone
                    self.engine.enqueue(arg)
            elif kind == "abort":
                out = self.engine.abort(arg)
                if out is not None:
                    self._deliver(arg, out)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
