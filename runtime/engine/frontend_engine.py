"""FrontendEngine: what the server asks of an engine, whichever side of a process boundary the engine runs on.

Each open request has an asyncio queue that the engine's deltas (or an error) are delivered to; a consumer that goes
away (a client disconnect, a cancellation) aborts its request so its pages return at once. AsyncLLM (the engine on a
thread of this process) and EngineCoreClient (the engine core in its own process) differ only in how a request is
submitted and how its outputs come back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ..lora.request import LoRARequest
from ..sampling.sampling_params import InvalidRequestError, SamplingParams
from .errors import EngineDeadError
from .outputs import EmbeddingRequestOutput, RequestOutput, merge_deltas


class FrontendEngine:
    def __init__(self):
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    # ---- what each kind of engine provides ------------------------------------------------------------------------
    async def start(self) -> None:
        """On the server's event loop, before it serves."""

    async def stop(self) -> None:
        """On the server's event loop, after it served."""

    def is_alive(self) -> bool:
        raise NotImplementedError

    def _submit_generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, lora_name: str | None
    ) -> Callable[[], None]:
        """Validates and tokenizes (raising InvalidRequestError or QueueFullError); returns what queues it."""
        raise NotImplementedError

    def _submit_embed(self, request_id: str, prompts: list[str | list[int]]) -> Callable[[], None]:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def list_loras(self) -> list[LoRARequest]:
        """The LoRA adapters requests may name now (none without --enable-lora)."""
        return []

    async def load_lora(self, name: str, path: str) -> None:
        """Loads an adapter under name (LoRAError naming the field when it cannot be served)."""
        raise NotImplementedError

    async def unload_lora(self, name: str) -> bool:
        """False: no adapter of that name."""
        raise NotImplementedError

    # ---- requests -------------------------------------------------------------------------------------------------
    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, lora_name: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Validates (raising InvalidRequestError or QueueFullError), then yields delta RequestOutputs; lora_name:
        a loaded LoRA adapter to run with (ModelNotFoundError when there is none of that name)."""
        self._check_alive()
        submit = self._submit_generate(request_id, prompt, params, lora_name)
        stream = self._open_stream(request_id)
        submit()
        finished = False
        held = None  # an error that queued behind deltas: raised after them
        try:
            while not finished:
                if held is not None:
                    item, held = held, None
                else:
                    item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                while not item.finished and not stream.empty():  # behind the engine: one chunk for what queued
                    later = stream.get_nowait()
                    if not isinstance(later, RequestOutput):
                        held = later
                        break
                    item = merge_deltas(item, later)
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (client disconnect, cancellation): free the pages now
                self.abort(request_id)

    async def embed(self, prompts: list[str | list[int]], request_id: str) -> list[EmbeddingRequestOutput]:
        """Validates (raising InvalidRequestError or QueueFullError), then waits for every input's embedding."""
        self._check_alive()
        submit = self._submit_embed(request_id, prompts)
        stream = self._open_stream(request_id)
        submit()
        done = False
        try:
            item = await stream.get()
            if isinstance(item, BaseException):
                raise item
            done = True
            return item
        finally:
            self._streams.pop(request_id, None)
            if not done:  # the client went away: its inputs leave the queue and their pages return now
                self.abort(request_id)

    def cancel_all(self, error: BaseException) -> int:
        """Ends every request in flight with `error`, so each client hears why; their pages are freed.
        Call from the server's event loop. Returns how many were cancelled."""
        cancelled = list(self._streams.items())
        for request_id, (loop, stream) in cancelled:
            loop.call_soon_threadsafe(stream.put_nowait, type(error)(*error.args))  # one instance each
            self.abort(request_id)
        return len(cancelled)

    # ---- streams --------------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.is_alive():
            raise EngineDeadError("the engine has stopped")

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        """The queue the engine answers this request on."""
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        if not self.is_alive():  # the engine died after the caller's check: nobody would answer this stream
            self._streams.pop(request_id, None)
            raise EngineDeadError("the engine has stopped")
        return stream

    def _deliver(self, request_id: str, item) -> None:
        """Hands a delta, a result or an error to the request's consumer; from any thread."""
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # its event loop has closed: nobody is listening any more
                self._streams.pop(request_id, None)

    def _fail_all(self, error_message: str) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(error_message))
