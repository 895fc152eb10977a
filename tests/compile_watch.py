"""The XLA compilations the calling thread makes while a block runs (tests of serve's warm-up and its stand-ins)."""

from __future__ import annotations

import contextlib
import threading

from jax import monitoring


@contextlib.contextmanager
def compiles_in_this_thread():
    """The XLA compilations this thread makes meanwhile (the warm-up's own thread compiles beside it)."""
    compiles: list[str] = []
    me = threading.current_thread()

    def listen(event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and threading.current_thread() is me:
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        monitoring.unregister_event_duration_listener(listen)
