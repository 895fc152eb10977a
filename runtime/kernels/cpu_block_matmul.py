"""The native CPU matmul for weights in GGUF's blocks of 32 (Q4_1, Q8_0): runtime/kernels/cpu/block_matmul.cc,
called from jitted programs through XLA FFI.

llama.cpp's way (activations quantized to int8 per block, int8 dot products with AVX-512 VNNI / AVX-VNNI / AVX2
picked at run time, the columns split over a small persistent thread pool, each weight block read once per call for
all rows), where XLA's CPU loops run each matmul on one thread and upcast the weight per row (benchmarks/RESULTS.md,
issue 66). The library is built by `make setup` (`python -m capstan.runtime.kernels.cpu_block_matmul`: g++, no
network) into the cache folder, keyed by the source's and jaxlib's hash (or found beside the sources under the same
name: the CPU image's, image/build.py); without it, or off CPUs, callers keep the pure-JAX path
(models/cpu_block_weight.py).

Environment: CAPSTAN_CPU_MATMUL_THREADS (default: the cores this process may run on, os.sched_getaffinity and the
cgroup's cpu.max), CAPSTAN_CPU_MATMUL_ISA (avx512vnni, avxvnni, avx2 or scalar; default the best this CPU runs),
CAPSTAN_CPU_MATMUL_SPIN_US (how long an idle worker spins before it sleeps, default 200),
CAPSTAN_CPU_MATMUL_ACTIVATION_LEVELS (2, the default: activations in two int8 levels, the float path's answers; 1:
llama.cpp's one level, as its Q4_1 arithmetic answers)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = ("block_matmul.cc", "block_matmul_body.inc", "parallel_for.h", "paged_attention.cc")  # one library
TARGET = "capstan_cpu_block_matmul"  # the FFI target's name in XLA's registry
BLOCK = 32
Q4_1, Q8_0 = 0, 1  # the kernel's `kind` attribute
# the activations' int8 levels: 2 (default) near float32 (the answers of XLA's float path), 1 llama.cpp's q8 arithmetic
ACTIVATION_LEVELS = int(os.environ.get("CAPSTAN_CPU_MATMUL_ACTIVATION_LEVELS", "2"))
# below this many multiply-adds a call stays on one thread (waking a worker costs ~ a few microseconds)
MIN_PARALLEL_MACS = int(os.environ.get("CAPSTAN_CPU_MATMUL_MIN_PARALLEL_MACS", str(1 << 16)))

_library: ctypes.CDLL | None = None
_loaded = False
_LOAD_LOCK = threading.RLock()  # load(): one thread loads the library, any other waits for it


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "capstan" / "kernels"


def _include_dir() -> str:
    return jax.ffi.include_dir()


def library_path() -> Path:
    """Where the built library lives: named by a hash of the sources and jaxlib's version (its FFI headers)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(jax.lib.__version__.encode() if hasattr(jax.lib, "__version__") else b"")
    import jaxlib

    digest.update(jaxlib.__version__.encode())
    return cache_dir() / f"block_matmul-{digest.hexdigest()[:16]}.so"


def build(force: bool = False) -> Path:
    """Compile the library (g++, -O3, no -march: the vector paths carry their own target attributes and are picked
    at run time, so the file runs on any x86-64). Returns its path."""
    out = library_path()
    if out.is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        command = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-pthread",
                   "-isystem", _include_dir(), *(str(SOURCE_DIR / name) for name in SOURCES if name.endswith(".cc")),
                   "-o", str(partial)]  # fmt: skip
        subprocess.run(command, check=True)
        partial.replace(out)  # atomic: a concurrent loader sees the whole file or none
    return out


def host_threads() -> int:
    """The cores this process may run on: its affinity mask, capped by the cgroup's CPU quota (a container's)."""
    env = os.environ.get("CAPSTAN_CPU_MATMUL_THREADS")
    if env:
        return max(1, int(env))
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            threads = min(threads, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, threads)


def load() -> ctypes.CDLL | None:
    """The library, loaded and registered with XLA once; None where it is not built, or not on x86-64. Thread-safe:
    serve's warm-up asks from several threads at once (each program store key names it), and a second thread that
    read None while the first still loaded it keyed a stored program as one without it: the next start missed it."""
    global _loaded
    if _loaded:
        return _library
    with _LOAD_LOCK:  # (re-entrant: configure() asks again from inside _open)
        if _loaded or _library is not None:
            return _library
        try:
            return _open()
        finally:
            _loaded = True


def _open() -> ctypes.CDLL | None:
    global _library
    try:
        path = library_path()
    except OSError as e:  # a source file missing (a package installed without it): as if never built
        log.warning("the native CPU kernels' sources are incomplete (%s); pure-JAX path", e)
        return None
    if not path.is_file() and (SOURCE_DIR / path.name).is_file():
        path = SOURCE_DIR / path.name  # built beside its sources: the CPU image ships it there (image/build.py)
    if not path.is_file():
        log.info("the native CPU block matmul is not built (%s): `make setup` builds it; pure-JAX path", path)
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:  # built against another libstdc++ or CPU family: as if never built
        log.warning("the native CPU block matmul does not load (%s); pure-JAX path", e)
        return None
    library.capstan_cpu_block_matmul_configure.argtypes = [
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_longlong,
    ]
    library.capstan_cpu_block_matmul_isa.restype = ctypes.c_char_p
    library.capstan_cpu_block_matmul_isas.restype = ctypes.c_char_p
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.CapstanCpuBlockMatmul), platform="cpu")
    _library = library
    configure(os.environ.get("CAPSTAN_CPU_MATMUL_ISA", ""), host_threads())
    log.info("native CPU block matmul: %s (%s, %d threads)", path, isa(), host_threads())
    return library


def configure(isa: str = "", threads: int | None = None) -> None:
    """Pick the instruction set ("": the best this CPU runs) and the thread count (tests try each)."""
    library = load()
    assert library is not None, "the native CPU block matmul is not built"
    spin_us = int(os.environ.get("CAPSTAN_CPU_MATMUL_SPIN_US", "200"))
    threads = host_threads() if threads is None else threads
    if library.capstan_cpu_block_matmul_configure(isa.encode(), threads, spin_us, MIN_PARALLEL_MACS) != 0:
        raise ValueError(f"this CPU does not run the {isa!r} path (it runs: {', '.join(isas())})")


def isas() -> list[str]:
    library = load()
    return [] if library is None else library.capstan_cpu_block_matmul_isas().decode().split(",")


def isa() -> str:
    library = load()
    return "" if library is None else library.capstan_cpu_block_matmul_isa().decode()


def available() -> bool:
    """Whether jitted programs can call the kernel: built, loaded, and JAX's backend is the CPU."""
    return jax.default_backend() == "cpu" and load() is not None


def pack(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A weight in blocks of 32 along its last axis ([n, k] int8; Q4_1's values 0..15 with `offset` its blocks'
    minimums, Q8_0's symmetric without) as the kernel reads it: (w, d, m, kind), in groups of 8 output columns (n
    padded with zero columns to a multiple of 8) whose 4-byte runs of inputs interleave (block_matmul.cc's comment).
    Q4_1's values two to a byte (half the bytes a step reads: input i low, i + 16 high); Q8_0's int8 as they are,
    with m the blocks' sums as int16 (the VNNI dot's u8 bias, 128 * m, taken back out). d and Q4_1's m are float16,
    as GGUF stores them (exact for a GGUF's weights; others' scales are rounded, as llama.cpp does when it quantizes):
    a decode step reads its weights from memory, and float32 scales made it 20% more bytes. ValueError where a scale
    or minimum does not fit float16 (the caller keeps the weight on XLA's path)."""
    q = np.asarray(q)
    n, k = q.shape
    nb, groups = k // BLOCK, -(-n // 8)
    pad = groups * 8 - n

    def grouped(a: np.ndarray) -> np.ndarray:  # [n, nb, ...] -> [groups, nb, ..., 8]: columns innermost
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        a = a.reshape(groups, 8, *a.shape[1:])
        return np.moveaxis(a, 1, -1)

    d = np.asarray(scale, np.float32).reshape(n, nb)
    with np.errstate(over="ignore"):  # an overflow is reported below, as a ValueError
        half = d.astype(np.float16)
    if not np.isfinite(half).all():
        raise ValueError(f"a block scale beyond float16's range ({np.abs(d).max():.3g})")
    if offset is not None:
        blocks = q.astype(np.uint8).reshape(n, nb, 2, 4, 4)  # [n, nb, low/high half, 4-byte run, byte]
        assert blocks.max(initial=0) < 16, "Q4_1 values are 0..15"
        nibbles = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # [n, nb, 4, 4]
        w = np.moveaxis(grouped(nibbles), -1, -2)  # [groups, nb, 4 runs, 8 columns, 4 bytes]
        with np.errstate(over="ignore"):
            m = np.asarray(offset, np.float32).reshape(n, nb).astype(np.float16)
        if not np.isfinite(m).all():
            raise ValueError("a block minimum beyond float16's range")
        kind = Q4_1
    else:
        w = np.moveaxis(grouped(q.astype(np.int8).reshape(n, nb, 8, 4)), -1, -2)  # [groups, nb, 8 runs, 8, 4]
        m = q.astype(np.int32).reshape(n, nb, BLOCK).sum(-1).astype(np.int16)  # |sum| <= 32 * 127
        kind = Q8_0
    as_c = np.ascontiguousarray
    return as_c(w), as_c(grouped(half)), as_c(grouped(m)), kind


def unpack(w: jax.Array, d: jax.Array, m: jax.Array, kind: int, n: int) -> jax.Array:
    """The float32 weight [n, k] a packed one stands for (the pure-JAX path, and tests)."""
    groups, nb, _ = d.shape
    if kind == Q4_1:
        runs = jnp.swapaxes(w, -1, -2)  # [groups, nb, 4 runs, 4 bytes, 8 columns]
        q = jnp.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(groups, nb, BLOCK, 8)
    else:
        q = jnp.swapaxes(w, -1, -2).reshape(groups, nb, BLOCK, 8)
    values = q.astype(jnp.float32) * d.astype(jnp.float32)[:, :, None, :]
    if kind == Q4_1:
        values = values + m.astype(jnp.float32)[:, :, None, :]
    return jnp.moveaxis(values, -1, 1).reshape(groups * 8, nb * BLOCK)[:n]


def matmul(
    xs: jax.Array, w: jax.Array, d: jax.Array, m: jax.Array, kind: int, n: int, levels: int | None = None
) -> jax.Array:
    """xs [rows, k] float32 times the packed weight's transpose: [rows, n] float32, in the native kernel. levels:
    the activations' int8 levels (default ACTIVATION_LEVELS): 1 is llama.cpp's q8 arithmetic, 2 adds a second
    level for what the first one's rounding left (float-path answers, twice the dot products; block_matmul.cc)."""
    rows = xs.shape[0]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32), vmap_method="sequential")
    levels = ACTIVATION_LEVELS if levels is None else levels
    return call(xs.astype(jnp.float32), w, d, m, kind=np.int32(kind), levels=np.int32(levels))


def main() -> None:
    """`make setup`'s step: build the library (a no-op when built), then check that it loads and runs."""
    if not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "AMD64"):
        print("native CPU block matmul: x86-64 Linux only; skipped (the pure-JAX path serves)")
        return
    try:
        path = build(force="--force" in sys.argv)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"native CPU block matmul: not built ({e}); CPUs keep XLA's loops") from e
    print(f"native CPU block matmul: {path} ({', '.join(isas())}; {host_threads()} threads)")


if __name__ == "__main__":
    main()
