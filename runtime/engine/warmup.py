"""BackgroundWarmup: `capstan serve` answers as soon as the programs a first request needs are compiled, and
compiles the engine's other step programs in a thread while it serves. A program with a stand-in (Program.stand_in:
the first shapes' layer-by-layer programs, layered_step.py) has the stand-in compiled instead before /ready, and is
the thread's first to compile.

Each program is compiled ahead of time (`jit(f).lower(args).compile()`, with the arguments a real call passes, so
the call later finds it in JAX's caches) and nothing runs on the device from the thread. Until a program is
compiled the engine runs one that is (LLMEngine.compiled): a larger token bucket, single steps instead of a
multi-step decode, the general step instead of a small one; each gives the same tokens. A program whose
compilation fails is logged and never run: its stand-in serves for good. A program the engine keeps whole
(program_store.py) loads instead of compiling when an earlier start kept it; keeping the first request's programs
waits for the thread."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

from .compile_counts import compilations, count_compilations, describe, hits_in_this_thread

log = logging.getLogger("capstan.engine")
SWITCH_INTERVAL_S = float(os.environ.get("CAPSTAN_WARMUP_SWITCH_INTERVAL_S", "0.0005"))
# before each program the thread waits this long at most while requests are in flight: an answer under way keeps
# the cores and the GIL (a first chat answer ~0.3 s sooner on 2 cores), and a busy server still gets its programs
YIELD_S = float(os.environ.get("CAPSTAN_WARMUP_YIELD_S", "2"))


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of the engine: key names its shape ("step", variant, tokens, rows), ...; lower traces
    and lowers it with the arguments a call passes (read when it runs: the engine's current cache and weights)."""

    key: Hashable
    lower: Callable[[], Iterable]  # the lowered computations (jax.stages.Lowered) the key needs, in order
    load: Callable[[], bool] | None = None  # the program from the engine's store, without tracing: True if it did
    keep: Callable[[list], None] | None = None  # stores what compiled (jax.stages.Compiled, in order) for later starts
    # compiles a quicker program giving the same tokens (layered_step.py), which compile_now runs instead while
    # the thread compiles this one first
    stand_in: Callable[[], None] | None = None


class BackgroundWarmup:
    def __init__(
        self,
        context: Callable[[], AbstractContextManager],
        busy: Callable[[], bool] | None = None,
        yield_s: float = YIELD_S,
    ):
        """busy: whether requests are in flight (the thread then waits up to yield_s before each program)."""
        self._busy = busy
        self._yield_s = yield_s
        """context: what every device call of the engine runs in (its matmul precision, its mesh)."""
        self._context = context
        self._ready: set[Hashable] = set()
        self._standing_in: set[Hashable] = set()  # keys whose stand-in (Program.stand_in) serves until they compile
        self._deferred: list[Program] = []  # compile_now's programs a stand-in serves: the thread's first
        self._failed: set[Hashable] = set()
        self._queue: list[Program] = []
        self._keeps: list[Callable[[], None]] = []  # what compile_now compiled, stored by the thread (off the path)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.loaded = 0  # programs loaded whole from the engine's store rather than compiled
        self.started = 0.0
        count_compilations()
        self.counted_from = compilations()

    def compile_now(self, programs: list[Program]) -> None:
        """Compiles these now (what the first request needs), side by side: XLA's compiler releases the GIL, so two
        programs compile on two cores; a failure here propagates. A program its load gives is not compiled; one with
        a stand-in has the stand-in compiled now and is itself compiled first by the thread."""

        def load_or_compile(program: Program) -> bool:
            """True when the program is ready; False when its stand-in is."""
            if program.stand_in is not None:
                if program.load is not None and program.load():
                    with self._lock:
                        self.loaded += 1
                    return True
                program.stand_in()
                return False
            keep = self._load_or_compile(program)
            if keep is not None:  # stored by the thread, off the first request's path
                with self._lock:
                    self._keeps.append(keep)
            return True

        with ThreadPoolExecutor(max(1, min(len(programs), os.cpu_count() or 1))) as pool:
            futures = [pool.submit(load_or_compile, program) for program in programs]
        for program, future in zip(programs, futures, strict=True):
            if future.result():
                self._ready.add(program.key)
            else:
                self._standing_in.add(program.key)
                self._deferred.append(dataclasses.replace(program, load=None))  # (its load just missed)

    def _load_or_compile(self, program: Program) -> Callable[[], None] | None:
        """Loads the program from the engine's store, or compiles it; what keeps it for later starts, if it should."""
        if program.load is not None and program.load():
            with self._lock:
                self.loaded += 1
            return None
        hits = hits_in_this_thread()
        compiled = self._compile(program)
        # XLA:CPU writes a broken copy of a program it read from JAX's cache ("Function ... not found" when it
        # runs): only programs compiled here are kept (the store checks again: JAX may hand this thread an
        # executable another thread read from its cache)
        if program.keep is None or hits_in_this_thread() != hits:
            return None
        keep = program.keep
        return lambda: keep(compiled)

    def start(self, programs: list[Program]) -> None:
        """Compiles these in order in a thread of its own (after compile_now's programs a stand-in serves)."""
        self._queue = self._deferred + list(programs)
        self._deferred = []
        self.started = time.monotonic()
        if self._queue or self._keeps:
            self._thread = threading.Thread(target=self._run, name="capstan-warmup", daemon=True)
            self._thread.start()

    def compiled(self, key: Hashable) -> bool:
        """Whether the key's shape can run now: its program compiled, or its stand-in."""
        return key in self._ready or key in self._standing_in

    def standing_in(self) -> int:
        """How many shapes run by their stand-ins now."""
        return len(self._standing_in - self._ready)

    def whole(self, key: Hashable) -> bool:
        """Whether the key's own program is compiled (not only its stand-in)."""
        return key in self._ready

    def compiling(self) -> int:
        """Programs not compiled (stood in for, queued, or being compiled now) or not stored yet."""
        with self._lock:
            return len(self._deferred) + len(self._queue) + len(self._keeps)

    def done(self) -> bool:
        return self.compiling() == 0

    def failed(self) -> int:
        return len(self._failed)

    def stop(self) -> bool:
        """No further compilation starts; True when none runs now. (A thread inside XLA's compiler when the
        interpreter exits aborts it: the engine core exits at once instead, see core_process.main.)"""
        with self._lock:
            self._stopped = True
            del self._queue[1:]  # the head is the program being compiled
            self._keeps.clear()
        return self._thread is None or not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the thread (tests, benchmarks); True when every program is done."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.done()

    def _compile(self, program: Program) -> list:
        with self._context():
            return [lowered.compile() for lowered in program.lower()]

    def _wait_while_busy(self) -> None:
        if self._busy is None:
            return
        deadline = time.monotonic() + self._yield_s
        while self._busy() and not self._stopped and time.monotonic() < deadline:
            time.sleep(0.01)

    def _run(self) -> None:
        # the lowest CPU priority (Linux: a thread's own; the compiler's threads inherit it): requests served
        # meanwhile keep the cores
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        # tracing holds the GIL: the engine's thread waits for it after every device call, up to the interpreter's
        # switch interval (5 ms) each time; a shorter one while this thread runs keeps its decode steps short
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            self._run_all()
        finally:
            sys.setswitchinterval(interval)

    def _run_all(self) -> None:
        while True:  # the first request's programs are stored first: the next start needs them soonest
            with self._lock:
                if not self._keeps or self._stopped:
                    break
                keep = self._keeps[0]
            keep()  # (best effort: the store logs what it could not keep)
            with self._lock:
                if self._keeps:
                    self._keeps.pop(0)
        total = len(self._queue)
        while True:
            self._wait_while_busy()
            with self._lock:
                if not self._queue:
                    break
                program = self._queue[0]
            try:
                store = self._load_or_compile(program)
                self._ready.add(program.key)  # (a set's add is atomic: the engine's thread reads it without the lock)
                if store is not None:
                    store()  # (best effort: the store logs what it could not keep)
            except Exception:  # noqa: BLE001 - a program that cannot compile is never run: its stand-in serves
                log.exception("compiling %s failed; a compiled program serves its steps instead", program.key)
                self._failed.add(program.key)
            with self._lock:
                self._queue.pop(0)
            log.debug("compiled %s (%d of %d)", program.key, total - self.compiling(), total)
        if self._stopped:
            return
        log.info(
            "background compilation done: %d programs in %.1f s%s%s (since the start: %s)",
            total - len(self._failed),
            time.monotonic() - self.started,
            f", {self.loaded} loaded whole from the program store in all" if self.loaded else "",
            f", {len(self._failed)} failed (see above)" if self._failed else "",
            describe(self.counted_from),
        )
