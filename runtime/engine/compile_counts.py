"""How many of the process's XLA compilations JAX's persistent cache answered: a later start of the same model (or
a pod of the image's baked default model) should compile nothing afresh, and the warm-up's log says whether it did."""

from __future__ import annotations

import threading

import jax

REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"  # every compilation that asked the cache
HITS = "/jax/compilation_cache/cache_hits"  # those it answered
_counts = {REQUESTS: 0, HITS: 0}
_lock = threading.Lock()
_thread = threading.local()  # the hits of the thread that compiles (JAX records them in it)
_listening = False


def _count(event: str, **_) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1
    if event == HITS:
        _thread.hits = getattr(_thread, "hits", 0) + 1


def hits_in_this_thread() -> int:
    """The cache's answers to this thread's compilations since counting started."""
    return getattr(_thread, "hits", 0)


def count_compilations() -> None:
    """Starts counting (once per process; JAX keeps its listeners for good)."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    jax.monitoring.register_event_listener(_count)


def compilations() -> tuple[int, int]:
    """(compilations that asked the persistent cache, those it answered) since counting started."""
    with _lock:
        return _counts[REQUESTS], _counts[HITS]


def describe(since: tuple[int, int]) -> str:
    """What happened since `since` (a compilations() value), for the log."""
    requests, hits = (now - then for now, then in zip(compilations(), since, strict=True))
    if not requests:
        return "no compilation cache in use" if not jax.config.jax_compilation_cache_dir else "nothing compiled"  # type: ignore[attr-defined]
    return f"{hits} loaded from the compilation cache, {requests - hits} compiled"
