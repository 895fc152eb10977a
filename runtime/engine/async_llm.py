"""AsyncLLM: the engine on its own thread, with an asyncio face for the server.

One engine thread owns all engine state and runs a plain loop: take new requests and aborts from a queue,
step, hand each request's deltas to its asyncio queue. The server's event loop never waits on the device."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from ..config import EngineConfig
from ..lora.request import LoRARequest
from ..sampling.sampling_params import SamplingParams
from .engine import LLMEngine
from .engine_stats import EngineStats
from .errors import EngineDeadError, QueueFullError, RequestCancelledError, RequestFailedError
from .frontend_engine import FrontendEngine

__all__ = ["AsyncLLM", "EngineDeadError", "QueueFullError", "RequestCancelledError", "RequestFailedError"]
log = logging.getLogger("capstan.engine")


class AsyncLLM(FrontendEngine):
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        super().__init__()
        self.engine = engine or LLMEngine(config)  # given: a multi-host LockstepEngine
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._dead = threading.Event()  # set before the failing loop tells its streams, so none is missed
        self._stop = threading.Event()
        self._stats = self.engine.stats()
        self._loras = self.engine.list_loras()  # refreshed by the engine thread when adapters change
        self._lora_ids = iter(range(len(self._loras) + 1, 1 << 62))
        self._thread = threading.Thread(target=self._run, name="capstan-engine", daemon=True)
        self._thread.start()

    # ---- state for probes and metrics ---------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.is_alive()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._dead.is_set()

    def stats(self) -> EngineStats:
        return self._stats  # refreshed by the engine thread after every step

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    # ---- requests -----------------------------------------------------------------------------------------
    def validate(self, params: SamplingParams) -> None:
        self.engine.validate(params)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        self.engine.check_prompt_chars(chars, param)

    @property
    def vocab_size(self) -> int:
        return self.engine.model.cfg.vocab_size

    @property
    def embedding_dimensions(self) -> int:
        return self.engine.embedder.dimensions

    def _submit_generate(self, request_id: str, prompt: str | list[int], params: SamplingParams, lora_name=None):
        seqs = self.engine.prepare(request_id, prompt, params, lora_name)
        free_slots = max(0, self.config.max_num_seqs - self._stats.running)
        if self._stats.waiting + self._commands.qsize() - free_slots >= self.config.max_waiting:
            raise QueueFullError(f"{self.config.max_waiting} requests are already waiting")
        return lambda: self._commands.put(("add", seqs))

    def _submit_embed(self, request_id: str, prompts: list[str | list[int]]):
        inputs = self.engine.embedder.prepare(request_id, prompts)
        if self._stats.waiting + self._commands.qsize() >= self.config.max_waiting:
            raise QueueFullError(f"{self.config.max_waiting} requests are already waiting")
        return lambda: self._commands.put(("embed", inputs))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def list_loras(self) -> list[LoRARequest]:
        return self._loras

    async def load_lora(self, name: str, path: str) -> None:
        lora = LoRARequest(name, next(self._lora_ids), path)
        weights = await asyncio.to_thread(self.engine.lora_manager().read, lora)  # files read off the engine thread
        await self._on_engine_thread(lambda: self.engine.add_lora(lora, weights))

    async def unload_lora(self, name: str) -> bool:
        return await self._on_engine_thread(lambda: self.engine.remove_lora(name))

    async def _on_engine_thread(self, call):
        """call() run by the engine thread between steps (adapters are engine state); its result or error here."""
        self._check_alive()
        loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                result, error = call(), None
            except Exception as e:  # noqa: BLE001 - the caller's to report
                result, error = None, e
            self._loras = self.engine.list_loras()

            def settle() -> None:
                if not done.done():
                    done.set_exception(error) if error is not None else done.set_result(result)

            loop.call_soon_threadsafe(settle)

        self._commands.put(("call", run))
        return await done

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
                embedder = self.engine.embedder
                self._take_commands(block=not (self.engine.has_unfinished() or embedder.has_work()))
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                if embedder.has_work():  # one embedding batch between generation steps: both progress
                    for request_id, outs in embedder.step():
                        self._deliver(request_id, outs)
                self._deliver_failures()
                self._stats = self.engine.stats()
        except BaseException as e:  # a device or engine fault: fail every request, stop (liveness turns false)
            self._dead.set()
            log.exception("engine loop failed; /health answers 503 so that the pod is restarted")
            self._fail_all(f"the engine failed ({type(e).__name__}); this server is restarting")

    def _deliver_failures(self) -> None:
        for request_id, error in self.engine.take_failed():
            self._deliver(
                request_id,
                RequestFailedError(
                    f"this request failed in the engine ({type(error).__name__}); the server goes on serving"
                ),
            )

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = command
            request_id = arg[0].request_id if kind in ("add", "embed") else arg
            try:
                if kind == "call":
                    arg()
                elif kind == "add":
                    if request_id in self._streams:  # its consumer may already have gone
                        self.engine.enqueue(arg)
                elif kind == "embed":
                    if request_id in self._streams:
                        self.engine.embedder.add(arg)
                elif kind == "abort":
                    self.engine.embedder.abort(request_id)
                    out = self.engine.abort(request_id)
                    if out is not None:
                        self._deliver(request_id, out)
            except Exception as e:  # noqa: BLE001 - this request's own fault: it fails, the loop goes on
                if kind == "embed":
                    self.engine.embedder.fail(request_id, e)
                elif kind == "add" and self.engine.requests.get(request_id) is not arg:
                    self.engine.failed.append((request_id, e))  # never queued: nothing to free
                else:
                    self.engine.fail(request_id, e)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
