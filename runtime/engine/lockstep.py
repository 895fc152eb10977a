"""One engine over several hosts with jax.distributed: one controller process per host, one global mesh.

Every process holds the same engine (the model split over all hosts' devices) and calls the same jitted steps
in the same order, which is what JAX's multi-controller model asks. Only the leader (process 0) takes requests:
before each step it broadcasts what changed since the last one (new requests with their seeds, aborts), and
every follower applies the same changes and takes the same step. The scheduler and the sampler are
deterministic functions of those inputs and of the step outputs (replicated on every device), so each host
schedules the same batch without the ~30 packed arrays of every step crossing the network; a fingerprint of the
leader's state travels with each broadcast and a follower that diverged stops with an error instead of hanging
in a collective. The hosts joined their group first (parallel/distributed.py)."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import signal
import threading
import time

import jax
import numpy as np

from ..config import EngineConfig
from ..parallel.follower_health import serve_probes
from ..sampling.sampling_params import SamplingParams
from .engine import LLMEngine

log = logging.getLogger("capstan.multihost")
SMALLEST_MESSAGE = 1024  # broadcast buffers are padded to powers of two from here: few compiled broadcasts
HEADER = 8  # the message's length, first in the first broadcast
HEARTBEAT_S = 5.0  # an idle leader still steps (with nothing to do) this often: no follower waits long in a collective


@dataclasses.dataclass(frozen=True)
class Added:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # with the leader's seed: every host draws the same samples


@dataclasses.dataclass(frozen=True)
class Aborted:
    request_id: str


STOP = "stop"  # the leader is done: followers leave their loop


class LockstepEngine(LLMEngine):
    """An LLMEngine whose steps every host takes together: the leader's enqueue/abort are recorded and sent with
    its next step; followers run follow() instead of serving."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_leader = jax.process_index() == 0
        self._changes: list[Added | Aborted] = []
        self._after_last_step = self._fingerprint()  # what every host's state must be before the next changes
        self._last_step_time = time.monotonic()
        # the embedder's steps are the leader's alone: they would hang the group
        self.embedder.refusal = "input: embeddings are not served across several hosts yet (JAX_NUM_PROCESSES > 1)"

    def has_unfinished(self) -> bool:
        """The leader's loops (AsyncLLM's, LLM.generate) step while this is true: also when idle for HEARTBEAT_S."""
        idle_too_long = self.is_leader and time.monotonic() - self._last_step_time > HEARTBEAT_S
        return super().has_unfinished() or idle_too_long

    def enqueue(self, seqs) -> None:
        super().enqueue(seqs)
        first = seqs[0]
        self._changes.append(
            Added(first.request_id, list(first.prompt_ids), dataclasses.replace(first.params, seed=first.seed))
        )

    def abort(self, request_id: str):
        if request_id in self.requests:
            self._changes.append(Aborted(request_id))
        return super().abort(request_id)

    def step(self):
        assert self.is_leader, "followers step in follow()"
        self._queued_done()
        self._send((self._changes, self._after_last_step))
        self._changes = []
        outputs = super().step()
        self._after_last_step = self._fingerprint()
        self._last_step_time = time.monotonic()
        return outputs

    def stop_followers(self) -> None:
        """The leader's last word: followers return from follow()."""
        self._send(STOP)

    def follow(self) -> None:
        """A follower's life: apply the leader's changes, take the same step, until the leader stops."""
        assert not self.is_leader
        while True:
            self._queued_done()
            message = self._receive()
            if message == STOP:
                return
            changes, fingerprint = message
            if fingerprint != self._fingerprint():  # this host's state after the last step, before the changes
                raise RuntimeError(
                    f"process {jax.process_index()} diverged from the leader: its state "
                    f"{self._fingerprint()} != the leader's {fingerprint}"
                )
            for change in changes:
                if isinstance(change, Added):
                    LLMEngine.enqueue(self, self.prepare(change.request_id, change.prompt_ids, change.params))
                else:
                    LLMEngine.abort(self, change.request_id)
            LLMEngine.step(self)
            self.take_failed()

    def _queued_done(self) -> None:
        """Waits until a decode dispatch queued ahead (multi_step.py, on the dispatch thread) has run: the broadcast
        that follows is a program with a collective too, and hosts that ran the two in different orders, or at once
        (CPU programs run concurrently), would mismatch in gloo or hang in NCCL. The pipeline pays for it: the next
        dispatch is queued only after the broadcast (two processes of one GPU each, 8B shape at TP=2: 148 ms a
        16-step dispatch against 130 in one process; benchmarks/RESULTS.md)."""
        ahead = self.multi_step.ahead
        if ahead is not None:
            self.multi_step.settle(ahead)
            jax.block_until_ready(ahead.out)

    def _fingerprint(self) -> tuple:
        return (len(self.requests), self.pool.num_used, self.generation_tokens, self.prompt_tokens)

    # ---- the wire: pickled bytes, length then payload, through JAX's own broadcast over the global mesh ------
    def _send(self, message) -> None:
        data = np.frombuffer(pickle.dumps(message), np.uint8)
        self._broadcast(data)

    def _receive(self):
        return pickle.loads(self._broadcast(None).tobytes())

    @staticmethod
    def _broadcast(data: np.ndarray | None) -> np.ndarray:
        """The leader's bytes (data) on every host (None: a follower's). One broadcast of SMALLEST_MESSAGE bytes, the
        length then the first bytes, carries a step's usual message; a longer one's rest follows in a second,
        padded to a power of two (few compiled broadcasts). Each is a collective every host waits on."""
        from jax.experimental import multihost_utils

        room = SMALLEST_MESSAGE - HEADER
        head = np.zeros(SMALLEST_MESSAGE, np.uint8)
        if data is not None:
            head[:HEADER] = np.frombuffer(np.uint64(data.size).tobytes(), np.uint8)
            head[HEADER : HEADER + min(data.size, room)] = data[:room]
        head = np.asarray(multihost_utils.broadcast_one_to_all(head))
        size = int(np.frombuffer(head[:HEADER].tobytes(), np.uint64)[0])
        if size <= room:
            return head[HEADER : HEADER + size]
        rest = size - room
        tail = np.zeros(max(SMALLEST_MESSAGE, 1 << (rest - 1).bit_length()), np.uint8)
        if data is not None:
            tail[:rest] = data[room:]
        return np.concatenate([head[HEADER:], np.asarray(multihost_utils.broadcast_one_to_all(tail))[:rest]])


def run_follower(config: EngineConfig, host: str = "0.0.0.0", port: int | None = None) -> int:
    """`capstan serve` on a host other than the leader: no API, the leader's steps until it stops or goes away
    (then jax.distributed ends this process too, and the pod restarts with the group). With a port, /health and
    /ready answer the probes. SIGTERM does not stop it: the leader drains its requests, which needs every host's
    steps, and ends the group when it exits."""
    ready = threading.Event()
    if port is not None:
        serve_probes(host, port, ready)
    signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: following until the leader has drained"))
    engine = LockstepEngine(config)
    if config.warmup:
        engine.warmup()  # the same programs, in the same order, as the leader's AsyncLLM compiles
    ready.set()
    log.info("following the leader's steps")
    engine.follow()
    return 0
