"""The engine core: one process that owns the device, the scheduler, the KV cache and the jitted steps, and does
nothing else. Frontends send it requests already tokenized and validated; it answers each frontend with its own
requests' outputs and the engine's stats after every step. It waits on its socket only while the engine is idle.

Started by `capstan serve` (runtime/server/processes.py) as `python -m capstan.runtime.engine.core_process`, its
CoreSpec on stdin;
it ignores SIGINT and SIGTERM (the serving process decides when it stops: after the frontends drained) and dies
with its parent."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import msgspec
import zmq

from ..kv.kv_event_publisher import KVEventPublisher
from ..kv.kv_events import KVEventLog
from ..lora.request import LoRAError, LoRARequest
from ..sampling.sampling_params import InvalidRequestError
from .core_messages import (
    Abort,
    Add,
    Dead,
    Embed,
    Failure,
    Loaded,
    LoadLoRA,
    LoRADone,
    LoRAs,
    Outputs,
    Ready,
    Shutdown,
    UnloadLoRA,
    decode_to_core,
    encode,
)
from .core_spec import CoreSpec
from .engine import LLMEngine
from .errors import ModelNotFoundError, QueueFullError
from .outputs import EmbeddingRequestOutput, RequestOutput
from .parent_death import die_with_parent

log = logging.getLogger("capstan.engine")
IDLE_POLL_MS = 500  # how long an idle core waits for a message before looking again
LORA_POLL_MS = 10  # likewise while a LoRA adapter's files are being read


class EngineCore:
    def __init__(self, spec: CoreSpec):
        self.zmq = zmq.Context()
        self.inbox = self.zmq.socket(zmq.PULL)
        self.inbox.bind(spec.input_address)
        self.outboxes = []
        for address in spec.output_addresses:
            outbox = self.zmq.socket(zmq.PUSH)
            outbox.setsockopt(zmq.SNDHWM, 0)  # outputs are never dropped; the frontend reads them as they come
            outbox.connect(address)
            self.outboxes.append(outbox)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.config = spec.config
        self.core = spec.core
        if spec.cpu_max_num_seqs is not None and jax.default_backend() == "cpu":  # decided here: only the core
            self.config.max_num_seqs = spec.cpu_max_num_seqs  # may start JAX's backend
        self.owner: dict[str, int] = {}  # request id -> the frontend that answers it
        # LoRA adapters being read off the loop (a download, a disk read), in arrival order: (message, its read)
        self.lora_reads: list[tuple[LoadLoRA, LoRARequest, Future]] = []
        self._lora_reader = ThreadPoolExecutor(1, thread_name_prefix="capstan-lora-load")
        self._lora_ids = itertools.count(1)
        self._compiling_told = 0  # programs_compiling as the frontends last heard it
        self.engine: LLMEngine | None = None
        self.kv_events: KVEventPublisher | None = None  # --kv-events-config: the prefix cache's events, each step

    def run(self) -> int:
        """Loads, warms up, serves until a Shutdown; a fault tells every frontend before the process exits."""
        ready = False
        try:
            self.engine = engine = LLMEngine(self.config)
            self._lora_ids = itertools.count(len(engine.list_loras()) + 1)
            events = self.config.kv_events_config
            if events is not None and events.publishes and engine.pool.enable_prefix_caching:
                engine.pool.events = KVEventLog(engine.pool.page_size, events.max_queue_size)
                self.kv_events = KVEventPublisher(events, engine.pool.events, self.core, self.zmq)
            self._broadcast(Loaded(engine.limits(), self.config, engine.model_name, self.core))
            self._broadcast(LoRAs(engine.list_loras(), self.core))
            if self.config.warmup:  # what a first request needs; the other programs compile while serving
                engine.start_warmup()
            self._answer(engine, [], [], [])  # the stats first (programs_compiling): a frontend ready says it
            self._broadcast(Ready(engine.compile_seconds, self.core))
            ready = True
            log.info("engine core ready: serving %d frontend(s)", len(self.outboxes))
            while self._serve_once(engine):
                pass
            return 0
        except BaseException as e:  # a device or engine fault: /health turns 503 in every frontend
            if not ready:  # the frontends exit with this message (EngineCoreClient.on_start_failure)
                if isinstance(e, ValueError):  # a setting or checkpoint the engine refuses: its message says which
                    log.error("the engine could not start: %s", e)
                else:
                    log.exception("the engine could not start")
                self._broadcast(Dead(f"the engine could not start: {e}", self.core))
                return 1
            log.exception("the engine core failed; its frontends answer /health with 503 so that the pod restarts")
            if self.engine is not None and self.engine.program_store is not None:
                self.engine.program_store.forget_loaded()
            self._broadcast(Dead(f"the engine failed ({type(e).__name__}); this server is restarting", self.core))
            return 1
        finally:
            if self.kv_events is not None:
                self.kv_events.close()
            for socket in (self.inbox, *self.outboxes):
                socket.close(linger=1000)  # the last words (Dead, the final outputs) still go out
            self.zmq.term()

    def _serve_once(self, engine: LLMEngine) -> bool:
        """Takes what arrived, steps once if there is work; False after a Shutdown."""
        embedder = engine.embedder
        busy = engine.has_unfinished() or embedder.has_work()
        outputs: list[RequestOutput] = []
        embeddings: list[tuple[str, list[EmbeddingRequestOutput]]] = []
        failures: list[Failure] = []
        took = self.poller.poll(0 if busy else LORA_POLL_MS if self.lora_reads else IDLE_POLL_MS)
        while took:
            try:
                message = decode_to_core(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(message, Shutdown):
                return False
            self._take(engine, message, outputs, failures)
        if self.lora_reads:
            self._finish_lora_reads(engine)
        if not took and not busy:
            if engine.stats().programs_compiling != self._compiling_told:  # the gauge moves while idle too
                self._answer(engine, [], [], [])
            return True
        if engine.has_unfinished():
            outputs += engine.step()
        if embedder.has_work():  # one embedding batch between generation steps: both progress
            embeddings += embedder.step()
        failures += [
            Failure(
                rid, "failed", f"this request failed in the engine ({type(e).__name__}); the server goes on serving"
            )
            for rid, e in engine.take_failed()
        ]
        self._answer(engine, outputs, embeddings, failures)
        return True

    def _take(
        self,
        engine: LLMEngine,
        message: Add | Embed | Abort | LoadLoRA | UnloadLoRA,
        outputs: list[RequestOutput],
        failures: list[Failure],
    ) -> None:
        if isinstance(message, (LoadLoRA, UnloadLoRA)):
            return self._take_lora(engine, message)
        if isinstance(message, Abort) and message.index is not None:  # its other choices go on
            engine.abort_choice(message.request_id, message.index)
            return
        if isinstance(message, Abort):  # its frontend stopped listening: nothing goes back
            self.owner.pop(message.request_id, None)
            engine.embedder.abort(message.request_id)
            engine.abort(message.request_id)
            return
        request_id = message.request.request_id
        self.owner[request_id] = message.frontend
        try:
            stats = engine.stats()
            if isinstance(message, Add):
                free_slots = max(0, self.config.max_num_seqs - stats.running)
                if stats.waiting - free_slots >= self.config.max_waiting:
                    raise QueueFullError(f"{self.config.max_waiting} requests are already waiting")
                engine.enqueue(engine.make_sequences(message.request))
            else:
                if stats.waiting >= self.config.max_waiting:
                    raise QueueFullError(f"{self.config.max_waiting} requests are already waiting")
                engine.embedder.add(engine.embedder.inputs_of(message.request))
        except QueueFullError as e:
            failures.append(Failure(request_id, "queue_full", str(e)))
        except InvalidRequestError as e:
            failures.append(Failure(request_id, "invalid", str(e), e.param))
        except ModelNotFoundError as e:  # its LoRA adapter was unloaded after its frontend looked
            failures.append(Failure(request_id, "not_found", str(e), e.name))
        except Exception as e:  # noqa: BLE001 - this request's own fault: it fails alone, the loop goes on
            log.exception("request %s could not be queued", request_id)
            if isinstance(message, Add) and request_id in engine.requests:
                engine.fail(request_id, e)  # reported with the step's failures
            else:
                failures.append(
                    Failure(
                        request_id,
                        "failed",
                        f"this request failed in the engine ({type(e).__name__}); the server goes on serving",
                    )
                )

    def _take_lora(self, engine: LLMEngine, message: LoadLoRA | UnloadLoRA) -> None:
        """An unload at once; a load's files are read off the loop (_finish_lora_reads registers it)."""
        outbox = self.outboxes[message.frontend]
        try:
            if isinstance(message, UnloadLoRA):
                found = engine.remove_lora(message.name)
                if found:  # before the answer: its frontend knows the new list when its caller hears back
                    self._broadcast(LoRAs(engine.list_loras(), self.core))
                outbox.send(encode(LoRADone(message.call_id, found=found, core=self.core)))
                return
            lora = LoRARequest(message.name, next(self._lora_ids), message.path)
            self.lora_reads.append((message, lora, self._lora_reader.submit(engine.lora_manager().read, lora)))
        except (LoRAError, InvalidRequestError) as e:
            field = e.field if isinstance(e, LoRAError) else e.param
            outbox.send(encode(LoRADone(message.call_id, str(e), field, core=self.core)))

    def _finish_lora_reads(self, engine: LLMEngine) -> None:
        """Registers the adapters whose files are read, in the order they were asked for, and answers."""
        changed, answers = False, []
        while self.lora_reads and self.lora_reads[0][2].done():
            message, lora, read = self.lora_reads.pop(0)
            try:
                engine.add_lora(lora, read.result())
                done, changed = LoRADone(message.call_id, core=self.core), True
            except LoRAError as e:
                done = LoRADone(message.call_id, str(e), e.field, core=self.core)
            except Exception as e:  # noqa: BLE001 - this adapter's own fault: the loop goes on
                log.exception("LoRA adapter %s could not be loaded", message.name)
                done = LoRADone(message.call_id, f"{type(e).__name__}: {e}", "lora_path", core=self.core)
            answers.append((message.frontend, done))
        if changed:  # before the answers: each frontend knows the new list when its caller hears back
            self._broadcast(LoRAs(engine.list_loras(), self.core))
        for frontend, done in answers:
            self.outboxes[frontend].send(encode(done))

    def _answer(
        self,
        engine: LLMEngine,
        outputs: list[RequestOutput],
        embeddings: list[tuple[str, list[EmbeddingRequestOutput]]],
        failures: list[Failure],
    ) -> None:
        """Each frontend gets its own requests' news, and every frontend the stats (its gauges and 429s)."""
        if self.kv_events is not None:  # the step's pages named and evicted (never blocks)
            self.kv_events.publish()
        by_frontend: dict[int, Outputs] = {}
        stats = engine.stats()
        self._compiling_told = stats.programs_compiling

        def message(request_id: str, finished: bool) -> Outputs | None:
            frontend = self.owner.pop(request_id, None) if finished else self.owner.get(request_id)
            if frontend is None:  # aborted by its frontend, which no longer listens for it
                return None
            if frontend not in by_frontend:
                by_frontend[frontend] = Outputs([], [], [], stats, self.core)
            return by_frontend[frontend]

        for out in outputs:
            if (m := message(out.request_id, out.finished)) is not None:
                out.prompt, out.prompt_token_ids = None, []  # the frontend has them: never resent per delta
                m.outputs.append(out)
        for request_id, outs in embeddings:
            if (m := message(request_id, True)) is not None:
                m.embeddings.append(outs)
        for failure in failures:
            if (m := message(failure.request_id, True)) is not None:
                m.failures.append(failure)
        for frontend, outbox in enumerate(self.outboxes):
            outbox.send(encode(by_frontend.get(frontend) or Outputs([], [], [], stats, self.core)))

    def _broadcast(self, message) -> None:
        data = encode(message)
        for outbox in self.outboxes:
            outbox.send(data)


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=CoreSpec)  # from the serving process
    die_with_parent(spec.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the serving process stops this one, after its drain
        signal.signal(sig, signal.SIG_IGN)
    tag = f"engine core {spec.core}" if spec.core else "engine core"
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s %(name)s [{tag}]: %(message)s")
    core = EngineCore(spec)
    code = core.run()
    warming = core.engine.warming if core.engine is not None else None
    if warming is not None and not warming.stop():  # a compilation still runs in its thread: exit without waiting
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
