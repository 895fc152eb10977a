"""The programs a first request needs, kept whole (executable and argument structure) beside JAX's compilation
cache, so that a later start loads them without tracing the model again.

JAX's persistent cache skips XLA, but to find a program it must first trace and lower the step in Python: for the
default model's 30 unrolled layers that was ~3 s of a ~11 s warm start on a 2-core machine, for each of the two
programs serve needs before /ready. A stored program is keyed by everything the trace depends on (Capstan's own
source, the versions of JAX, jaxlib, equinox and haliax, the arguments' structure and shapes, the dtype, the
XLA flags, the CPU) and checked again against the live arguments when it loads; anything unexpected (a missing,
corrupt or foreign file) means the program is traced and compiled as before. Single-device engines only."""

from __future__ import annotations

import copyreg
import functools
import hashlib
import logging
import os
import pickle
import re
import zlib
from importlib.metadata import version
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from ..compilation_cache import cpu_fingerprint

log = logging.getLogger("capstan.engine")
STORE_FORMAT = 1  # bump when what a stored program holds changes
PREFIX = "capstan-program-"  # beside JAX's own "jit_*-cache" files: an image's bake copies both
ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # a repr's object address: differs from one process to the next
MACHINE_CODE = b"\x7fELF"  # XLA:CPU serialises a program's kernels as ELF objects


try:  # equinox's generated unflatten tests its MISSING sentinel by identity: an argument structure read back from
    # a file must hold that very object, not a copy of it (a private name: without it, nothing is stored)
    from equinox._module._flatten import MISSING, _Missing

    AVAILABLE = True
except ImportError:
    AVAILABLE = False


def _equinox_missing():
    return MISSING


if AVAILABLE:
    copyreg.pickle(_Missing, lambda _: (_equinox_missing, ()))


@functools.cache
def code_digest() -> str:
    """Capstan's source and the versions of what traces it: a change to either is another program."""
    digest = hashlib.sha256(str(STORE_FORMAT).encode())
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    for distribution in ("jax", "jaxlib", "equinox", "haliax"):
        digest.update(f"{distribution}=={version(distribution)}".encode())
    return digest.hexdigest()


def native_kernels(platform: str) -> str:
    """Which native CPU kernels a trace here calls, and how (their FFI targets registered as a side effect: a stored
    program calls them by name, so they must be registered before it loads, with no trace to do it)."""
    if platform != "cpu":
        return ""
    from ..kernels import cpu_block_matmul, cpu_paged_attention

    matmul = cpu_block_matmul.available()
    return f"matmul={matmul} levels={cpu_block_matmul.ACTIVATION_LEVELS} attention={cpu_paged_attention.available()}"


def _has_machine_code(executable: bytes) -> bool:
    return jax.devices()[0].platform != "cpu" or MACHINE_CODE in executable


class ProgramStore:
    def __init__(self, folder: Path, context: str):
        """folder: JAX's compilation cache; context: what else the trace depends on (the engine's dtype)."""
        self.folder = folder
        self.context = context
        self.loaded: list[Path] = []  # the files this engine runs programs from

    def path(self, name, args) -> Path:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        digest = hashlib.sha256()
        backend = jax.devices()[0].client
        for part in (
            code_digest(),
            self.context,
            repr(name),
            ADDRESS.sub("", str(treedef)),
            repr([(tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves]),
            backend.platform,
            backend.platform_version,
            cpu_fingerprint(),
            os.environ.get("XLA_FLAGS", ""),
            str(jax.config.jax_enable_x64),  # type: ignore[attr-defined]  # set at run time
            native_kernels(backend.platform),
        ):
            digest.update(part.encode() + b"\0")
        return self.folder / f"{PREFIX}{digest.hexdigest()[:32]}"

    def load(self, name, args) -> jax.stages.Compiled | None:
        """The stored program for these arguments, or None (none stored, or unusable: then it is removed)."""
        path = self.path(name, args)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            executable, in_tree, out_tree = pickle.loads(zlib.decompress(data))
            if not _has_machine_code(executable):  # (written by an older Capstan: it would fail when it runs)
                raise ValueError("it holds no machine code")
            compiled = serialize_executable.deserialize_and_load(executable, in_tree, out_tree)
            if compiled.in_tree != jax.tree_util.tree_structure((args, {})):
                raise ValueError("its arguments' structure is not this engine's")
        except Exception as e:  # noqa: BLE001 - any damage: trace and compile as before
            log.warning("stored program %s unusable (%s); compiling it", path.name, e)
            path.unlink(missing_ok=True)
            return None
        self.loaded.append(path)
        return compiled

    def forget_loaded(self) -> None:
        """The engine failed while it ran stored programs: the next start traces and compiles them afresh, so that
        a stored program that cannot run never fails a start twice."""
        for path in self.loaded:
            path.unlink(missing_ok=True)
            log.warning("removed stored program %s: the engine failed while it ran it", path.name)
        self.loaded.clear()

    def save(self, name, args, compiled: jax.stages.Compiled) -> None:
        """Best effort: a program that cannot be kept is traced again at the next start."""
        path = self.path(name, args)
        if path.exists():
            return
        partial = path.with_name(f".{path.name}.partial")
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            if not _has_machine_code(executable):
                # XLA:CPU re-serialises a program it read from JAX's cache without its kernels ("Function ... not
                # found" when it runs); JAX hands that same executable to any later compilation of the program in
                # this process, whichever thread asks
                log.info("not keeping program %s: XLA holds it without its machine code (read from JAX's cache)", name)
                return
            partial.write_bytes(zlib.compress(pickle.dumps((executable, in_tree, out_tree)), 1))
            os.replace(partial, path)  # whole or absent
        except Exception as e:  # noqa: BLE001 - an unwritable folder, an executable that cannot be serialised
            log.warning("could not keep program %s: %s", name, e)
            partial.unlink(missing_ok=True)
