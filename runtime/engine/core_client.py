"""EngineCoreClient: the engine core (core_process.py), running in its own process, as a frontend sees it.

The frontend validates and tokenizes here (InputProcessor: no device, no engine state), pushes the tokenized request
to the core, and reads its outputs on its own socket from the server's event loop; the core's process is watched
through a pidfd, so a core that dies (SIGKILL, out of memory) fails /health and ends every open stream at once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from ..config import EngineConfig
from ..lora.request import LoRAError, LoRARequest
from ..sampling.sampling_params import InvalidRequestError, SamplingParams
from ..tokenizer import Tokenizer
from .core_loads import CoreLoads
from .core_messages import (
    Abort,
    Add,
    Dead,
    Embed,
    Loaded,
    LoadLoRA,
    LoRADone,
    LoRAs,
    Outputs,
    Ready,
    UnloadLoRA,
    decode_from_core,
    encode,
)
from .engine_stats import EngineStats
from .errors import EngineDeadError, EngineNotReadyError, ModelNotFoundError, QueueFullError, RequestFailedError
from .frontend_engine import FrontendEngine
from .input_processor import InputProcessor
from .request_text import RequestText

log = logging.getLogger("capstan.engine")


@dataclasses.dataclass
class OpenRequest:
    """What the core does not resend: the prompt; and what it does not do: the text (request_text.py)."""

    prompt_text: str | None
    prompt_ids: list[int]
    text: RequestText


NO_STATS = EngineStats(
    running=0,
    waiting=0,
    kv_pages_used=0,
    kv_pages_total=0,
    prefix_cache_queried_tokens=0,
    prefix_cache_hit_tokens=0,
    preemptions=0,
    prompt_tokens=0,
    generation_tokens=0,
)


class EngineCoreClient(FrontendEngine):
    """One frontend's view of the engine cores: one, or --data-parallel-size of them, each a replica of the model on
    its own devices; a request goes to the core with the least load."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        model_name: str,
        *,
        frontend: int,
        input_addresses: list[str],
        output_address: str,
        core_pids: list[int],
    ):
        super().__init__()
        self.config, self.tokenizer, self.model_name = config, tokenizer, model_name
        self.frontend = frontend
        self._input_addresses, self._output_address, self._core_pids = input_addresses, output_address, core_pids
        cores = len(core_pids)
        self.inputs: InputProcessor | None = None  # once a core has loaded the model and said its limits
        self._eos_token_ids: frozenset[int] = frozenset()
        self._loads = CoreLoads(cores, NO_STATS, frontend)  # also each open request's core (generation, embeddings)
        self._ready = [False] * cores
        self._dead: str | None = None  # why a core stopped (the pod restarts as a whole)
        # called with the reason when a core dies before it was ever ready (the server then exits 1, as vLLM's)
        self.on_start_failure: Callable[[str], None] | None = None
        self._open: dict[str, OpenRequest] = {}  # each open generation request's prompt and text
        self._reader: asyncio.Task | None = None
        self._pidfds: list[int] = []
        self._loras: list[dict[str, LoRARequest] | None] = [None] * cores  # each core's adapters, by name
        self._lora_calls: dict[str, tuple[asyncio.Future, list[LoRADone]]] = {}  # call id -> (result, answers)

    # ---- lifetime: on the server's event loop ----------------------------------------------------------------------
    async def start(self) -> None:
        self._sync = zmq.Context()
        self._outboxes = []
        for address in self._input_addresses:
            outbox = self._sync.socket(zmq.PUSH)
            outbox.setsockopt(zmq.SNDHWM, 0)  # a request is never dropped on the way to its core
            outbox.connect(address)
            self._outboxes.append(outbox)
        self._async = zmq.asyncio.Context()
        self._inbox = self._async.socket(zmq.PULL)  # every core pushes to it
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(self._output_address)
        self._reader = asyncio.create_task(self._read())
        loop = asyncio.get_running_loop()
        for core, pid in enumerate(self._core_pids):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._core_died(f"engine core {core} is gone; this server is restarting")
                return
            self._pidfds.append(fd)
            loop.add_reader(fd, self._core_died, f"engine core {core} exited; this server is restarting")

    @property
    def cores(self) -> int:
        """Engine cores (--data-parallel-size), each with its own prefix cache (and KV events endpoint)."""
        return len(self._core_pids)

    async def stop(self) -> None:
        """Closes this frontend's sockets; the serving process stops the cores itself, after every frontend."""
        if self._reader is not None:
            self._reader.cancel()
        self._close_pidfds()
        for outbox in self._outboxes:
            outbox.close(linger=0)
        self._inbox.close(linger=0)

    def shutdown(self, timeout: float = 0.0) -> None:
        """Nothing left to do: stop() closed the sockets on the server's loop."""

    def _close_pidfds(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._pidfds:
            loop.remove_reader(fd)
            os.close(fd)
        self._pidfds = []

    # ---- state for probes and metrics ------------------------------------------------------------------------------
    def is_ready(self) -> bool:
        return all(self._ready) and self.is_alive()

    def is_alive(self) -> bool:
        return self._dead is None

    def stats(self) -> EngineStats:
        """The cores' stats (sent with every step's outputs), added up."""
        if len(self._loads.stats) == 1:
            return self._loads.stats[0]
        return add_stats(self._loads.stats)

    @property
    def vocab_size(self) -> int:
        return self._loaded().limits.vocab_size

    @property
    def embedding_dimensions(self) -> int:
        return self._loaded().limits.hidden_size

    # ---- requests --------------------------------------------------------------------------------------------------
    def validate(self, params: SamplingParams) -> None:
        self._loaded().validate(params)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        self._loaded().check_prompt_chars(chars, param)

    def _submit_generate(self, request_id: str, prompt: str | list[int], params: SamplingParams, lora_name=None):
        inputs = self._loaded()
        if lora_name is not None and not any(lora.lora_name == lora_name for lora in self.list_loras()):
            raise ModelNotFoundError(lora_name)
        request = inputs.process(request_id, prompt, params)
        request.lora_name = lora_name
        request.text_in_engine = False  # detokenization and stop strings happen here, off the core's loop
        data = encode(Add(self.frontend, request))
        text = RequestText(self.tokenizer, request, self._eos_token_ids)

        def submit() -> None:
            self._open[request_id] = OpenRequest(request.prompt_text, request.prompt_ids, text)
            self._send(request_id, data)

        return submit

    def _submit_embed(self, request_id: str, prompts: list[str | list[int]]):
        data = encode(Embed(self.frontend, self._loaded().embedding(request_id, prompts)))
        return lambda: self._send(request_id, data)

    def _send(self, request_id: str, data: bytes) -> None:
        """To the core with the least load (core_loads.py)."""
        core = self._loads.pick(request_id)
        self._outboxes[core].send(data)

    def abort(self, request_id: str, index: int | None = None) -> None:
        core = self._loads.core_of(request_id)
        if index is None:
            self._open.pop(request_id, None)
            self._loads.done(request_id)
        if core is not None and self.is_alive():
            self._outboxes[core].send(encode(Abort(request_id, index)))

    # ---- LoRA adapters ---------------------------------------------------------------------------------------------
    def list_loras(self) -> list[LoRARequest]:
        """The adapters every core has (each core says its own after every change)."""
        known = [names for names in self._loras if names is not None]
        if not known:
            return []
        return [lora for name, lora in known[0].items() if all(name in names for names in known[1:])]

    async def load_lora(self, name: str, path: str) -> None:
        await self._lora_call(lambda call_id: LoadLoRA(self.frontend, call_id, name, path))

    async def unload_lora(self, name: str) -> bool:
        answers = await self._lora_call(lambda call_id: UnloadLoRA(self.frontend, call_id, name))
        return any(a.found for a in answers)

    async def _lora_call(self, message) -> list[LoRADone]:
        """The message to every core (each is a replica: each loads the adapter); their answers once all came."""
        self._check_alive()
        self._loaded()
        call_id = uuid.uuid4().hex
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._lora_calls[call_id] = (done, [])
        data = encode(message(call_id))
        for outbox in self._outboxes:
            outbox.send(data)
        try:
            answers = await done
        finally:
            self._lora_calls.pop(call_id, None)
        failed = next((a for a in answers if a.error is not None), None)
        if failed is not None:
            raise LoRAError(failed.error, failed.field)
        return answers

    def _take_lora_done(self, message: LoRADone) -> None:
        call = self._lora_calls.get(message.call_id)
        if call is not None:
            done, answers = call
            answers.append(message)
            if len(answers) == len(self._outboxes) and not done.done():
                done.set_result(answers)

    def _loaded(self) -> InputProcessor:
        if self.inputs is None:
            raise EngineNotReadyError("the model is still loading; retry when /ready answers 200")
        return self.inputs

    # ---- the core's messages ---------------------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)  # on this loop already: no thread hop
        if target is not None:
            target[1].put_nowait(item)

    async def _read(self) -> None:
        while True:
            message = decode_from_core(await self._inbox.recv())
            if isinstance(message, Outputs):
                self._loads.stats[message.core] = message.stats
                self._take_outputs(message)
            elif isinstance(message, Loaded):  # every core loads the same model with the same flags
                self.config = message.config  # as resolved there (num_pages, max_model_len, max_num_seqs)
                self.inputs = InputProcessor(self.tokenizer, message.limits)
                self._eos_token_ids = frozenset(message.limits.eos_token_ids)
            elif isinstance(message, LoRAs):
                self._loras[message.core] = {lora.lora_name: lora for lora in message.loras}
            elif isinstance(message, LoRADone):
                self._take_lora_done(message)
            elif isinstance(message, Ready):
                self._ready[message.core] = True
            elif isinstance(message, Dead):
                self._core_died(message.message)
                return

    def _take_outputs(self, message: Outputs) -> None:
        for out in message.outputs:
            request = self._open.get(out.request_id)
            if request is None:  # aborted here already
                continue
            out.prompt, out.prompt_token_ids = request.prompt_text, request.prompt_ids
            finished_in_core = out.finished
            stopped = request.text.apply(out)
            if out.finished:
                del self._open[out.request_id]
                self._loads.done(out.request_id)
                if stopped and not finished_in_core:  # every choice has ended here: the core stops them all
                    self.abort(out.request_id)
            else:
                for index in stopped:
                    self.abort(out.request_id, index)
            self._deliver(out.request_id, out)
        for outs in message.embeddings:
            request_id = outs[0].request_id.rpartition("-")[0]  # each input's id is its request's, then -index
            self._loads.done(request_id)
            self._deliver(request_id, outs)
        for f in message.failures:
            self._open.pop(f.request_id, None)
            self._loads.done(f.request_id)
            error = (
                InvalidRequestError(f.message, f.param)
                if f.kind == "invalid"
                else ModelNotFoundError(f.param or "")
                if f.kind == "not_found"
                else QueueFullError(f.message)
                if f.kind == "queue_full"
                else RequestFailedError(f.message)
            )
            self._deliver(f.request_id, error)

    def _core_died(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        if not all(self._ready) and self.on_start_failure is not None:  # a setting, the checkpoint, the devices
            self.on_start_failure(reason)
        else:
            log.error("%s: /health answers 503 so that the pod is restarted", reason)
        self._close_pidfds()
        self._fail_all(reason)
        for done, _ in self._lora_calls.values():
            if not done.done():
                done.set_exception(EngineDeadError(reason))


def add_stats(stats: list[EngineStats]) -> EngineStats:
    """Several engine cores' stats as one engine's: every count added up (accepted tokens by position too)."""
    total: dict[str, Any] = {}
    for field in dataclasses.fields(EngineStats):
        values = [getattr(s, field.name) for s in stats]
        if isinstance(values[0], tuple):
            width = max(map(len, values))
            total[field.name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        else:
            total[field.name] = sum(values)
    return EngineStats(**total)
