"""Suite-wide hooks:
- the test in progress written to a file, so a run killed by a signal (SIGABRT from native code, the OOM killer)
  still names the test it was in; .ci/run prints it when `make test` fails (a file per CAPSTAN_TEST_GROUP: `make
  test` runs three pytest processes, two at a time).
- XLA's compiled programs kept on disk (JAX's persistent compilation cache, ~/.cache/capstan/test-xla) for this
  process, the servers it starts and later runs: most of the CPU suite's time is compiling, and many tests and
  server processes compile the same programs (tests/test_engine_golden.py: 201 s cold, 82 s warm). A
  JAX_COMPILATION_CACHE_DIR already set is kept.
- JAX's compiled programs dropped after a test module once the process holds many memory maps: XLA's CPU backend
  maps each compiled program's code in small pieces, and module-level jitted functions (the engine's steps) keep
  every program they compiled for the whole session; past the kernel's vm.max_map_count (65,530 by default) an
  allocation fails inside native code and the whole run dies (SIGSEGV or SIGABRT in XLA's compiler, seen at
  64,587 maps in tests/test_engine_golden.py, about 500 tests in)."""

import contextlib
import gc
import os
import sys
from pathlib import Path

import pytest

PROGRESS = Path(os.environ.get("TMPDIR", "/tmp")) / f"capstan-test-progress{os.environ.get('CAPSTAN_TEST_GROUP', '')}"
COMPILATION_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "capstan" / "test-xla"
COMPILATION_CACHE_BYTES = 4 << 30  # JAX evicts the least recently used programs past this


def _persist_compilations() -> None:
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    try:
        COMPILATION_CACHE.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable home: every process compiles for itself, as without the cache
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(COMPILATION_CACHE)  # (read when jax is imported, here and in servers)
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(COMPILATION_CACHE_BYTES))
    if "jax" in sys.modules:  # (imported before this file by a plugin: set it there too)
        sys.modules["jax"].config.update("jax_compilation_cache_dir", str(COMPILATION_CACHE))
        sys.modules["jax"].config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)


_persist_compilations()
MAX_MAPS = int(os.environ.get("CAPSTAN_TEST_MAX_MAPS", "20000"))  # well under the kernel's default 65,530


def pytest_runtest_logstart(nodeid: str, location) -> None:
    with contextlib.suppress(OSError):  # a read-only or missing TMPDIR must not fail the suite
        PROGRESS.write_text(nodeid + "\n")


def memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to guard
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
    yield
    if "jax" not in sys.modules or memory_maps() <= MAX_MAPS:
        return
    before = memory_maps()
    sys.modules["jax"].clear_caches()  # a later use compiles again (the session's shared engine too)
    gc.collect()
    if os.environ.get("CAPSTAN_TEST_MAPS_LOG"):
        print(f"\n[conftest] memory maps {before} -> {memory_maps()} after jax.clear_caches()", file=sys.stderr)
