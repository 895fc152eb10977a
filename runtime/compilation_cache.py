"""Where `capstan serve` and `capstan generate` keep compiled programs across starts, and the programs an image
brings for its default model.

Only the first start of a model and shape pays for XLA (about 40 s of CPU for SmolLM2 on a 2-core machine); later
starts load the programs, which JAX keys by program, JAX version, flags and device kind. Every program is kept, the
sub-second ones too (JAX's default keeps only those that took a second or more): each one a start loads instead of
compiling is a few hundred milliseconds sooner.

XLA:CPU compiles for the host's instruction set, which JAX's key does not include (XLA refuses, with an error in
the log, a program compiled for features the host lacks), so programs baked into an image (CAPSTAN_BAKED_PROGRAMS:
`make image` runs image/bake_programs.py) sit in a folder named for the CPU that compiled them, and a start copies
them into its cache only on a CPU with the same features; the default model's GGUF index (models/gguf_index.py),
the same on every CPU, sits in its gguf/ folder and is copied the same way."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

from .config import COMPILATION_CACHE
from .gguf_metadata import GGUF_INDEXES

log = logging.getLogger("capstan")
BAKED_PROGRAMS = "CAPSTAN_BAKED_PROGRAMS"  # a folder of <cpu_fingerprint()>/ folders of compiled programs
BAKED_GGUF_INDEXES = "gguf"  # its folder of GGUF indexes (any CPU's)
CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
MIN_COMPILE_SECONDS = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# JAX's default turns on XLA:GPU's autotune cache at <cache folder>/..., and that path goes into every program's key:
# programs compiled under one folder (an image's bake) were never found under another (a pod's cache). Off by default
XLA_CACHES = "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"


def cpu_fingerprint() -> str:
    """The machine and its CPU's feature flags, hashed: what XLA:CPU's code depends on."""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features"):  # x86, Arm
                    flags = line.split(":", 1)[1].split()
                    break
    except OSError:
        pass
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]
    return f"{platform.machine()}-{digest}"


def persist_compilations() -> Path | None:
    """Chooses the compilation cache (JAX_COMPILATION_CACHE_DIR, else ~/.cache/capstan/xla) and copies the image's
    baked programs for this CPU into it; None when it is off (an unwritable folder). Set through the environment,
    which JAX reads when imported (here or in an engine core): `capstan serve` starts its cores before it imports
    JAX itself."""
    jax = sys.modules.get("jax")  # imported already only when this runs inside a program that uses JAX
    chosen = jax.config.jax_compilation_cache_dir if jax else os.environ.get(CACHE_DIR)
    folder = Path(chosen or COMPILATION_CACHE)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache off: %s", e)
        return None
    os.environ[CACHE_DIR] = str(folder)
    os.environ.setdefault(MIN_COMPILE_SECONDS, "0")
    os.environ.setdefault(XLA_CACHES, "none")  # keys that do not name the folder: baked programs hit anywhere
    if jax:
        jax.config.update("jax_compilation_cache_dir", str(folder))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(os.environ[MIN_COMPILE_SECONDS]))
        jax.config.update("jax_persistent_cache_enable_xla_caches", os.environ[XLA_CACHES])
    seed_from_image(folder)
    return folder


def seed_from_image(folder: Path) -> int:
    """Copies the programs baked for this CPU (CAPSTAN_BAKED_PROGRAMS) that the cache lacks, and the baked GGUF
    indexes; how many programs."""
    if not (root := os.environ.get(BAKED_PROGRAMS)):
        return 0
    copy_missing(Path(root) / BAKED_GGUF_INDEXES, GGUF_INDEXES)
    fingerprint = cpu_fingerprint()
    baked = Path(root) / fingerprint
    if not baked.is_dir():
        log.info("no programs are baked into the image for this CPU (%s): they compile at start", fingerprint)
        return 0
    copied = copy_missing(baked, folder)
    log.info("%d compiled program(s) of the image's default model copied into %s", copied, folder)
    return copied


def copy_missing(source: Path, folder: Path) -> int:
    """Each file of source that folder lacks, copied whole or not at all; a failure is a warning."""
    copied = 0
    try:
        if not source.is_dir():
            return 0
        folder.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
            target = folder / item.name
            if item.name.startswith(".") or not item.is_file() or target.exists():
                continue
            partial = target.with_name(f".{item.name}.partial")
            shutil.copyfile(item, partial)
            os.replace(partial, target)  # whole or absent: JAX never reads half a program
            copied += 1
    except OSError as e:
        log.warning("copying the image's files from %s into %s stopped: %s", source, folder, e)
    return copied
