"""Run by image/build.py in the CPU image's finished root filesystem, as the image's user with its environment:
`capstan serve` of the image's default model, as a pod of it starts, until every program is compiled. The programs
stay under CAPSTAN_BAKED_PROGRAMS/<this CPU's fingerprint> and the model's GGUF index under
CAPSTAN_BAKED_PROGRAMS/gguf; a pod's start copies them into its caches (runtime/compilation_cache.py), the
programs only on a CPU with the same features. Prints what it baked; exits 1 if serve fails."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from capstan.runtime.compilation_cache import BAKED_GGUF_INDEXES, BAKED_PROGRAMS, CACHE_DIR, cpu_fingerprint

TIMEOUT_SECONDS = 840  # ready, then every program compiled, on a busy 2-core machine (~3 min there)
COMPILING = "capstan_programs_compiling"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except OSError:
        return 0, ""


def compiling(metrics: str) -> float | None:
    return next((float(line.split()[1]) for line in metrics.splitlines() if line.startswith(COMPILING + " ")), None)


def main() -> int:
    root = Path(os.environ[BAKED_PROGRAMS])
    programs = root / cpu_fingerprint()
    programs.mkdir(parents=True, exist_ok=True)
    caches = Path(tempfile.mkdtemp())  # the serve's own XDG cache: its GGUF index is taken from it
    env = {**os.environ, CACHE_DIR: str(programs), "XDG_CACHE_HOME": str(caches)}
    del env[BAKED_PROGRAMS]  # nothing to seed from: this run makes them
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(
            ["capstan", "serve", "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1]],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while (left := compiling(get(f"{url}/metrics")[1])) != 0 or get(f"{url}/ready")[0] != 200:
                if server.poll() is not None or time.monotonic() - started > TIMEOUT_SECONDS:
                    log.seek(0)
                    print(f"capstan serve did not compile every program ({left} left):\n{log.read()[-4000:]}")
                    return 1
                time.sleep(0.5)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    indexes = root / BAKED_GGUF_INDEXES
    shutil.copytree(caches / "capstan" / "gguf", indexes, dirs_exist_ok=True)
    shutil.rmtree(caches, ignore_errors=True)
    baked = sorted(p for p in programs.iterdir() if not p.name.startswith("."))
    for p in programs.iterdir():
        if p.name.startswith("."):  # JAX's lock files
            p.unlink()
    size = sum(p.stat().st_size for p in baked)
    print(
        f"baked {len(baked)} programs ({size / 2**20:.1f} MiB) for CPU {programs.name} and "
        f"{len(list(indexes.iterdir()))} GGUF index(es) in {time.monotonic() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
