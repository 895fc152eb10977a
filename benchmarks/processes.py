"""A benchmark again in N processes joined by jax.distributed on 127.0.0.1, process i on GPU i (on CPUs: one CPU
device each, gloo's collectives): one process per GPU, as vLLM runs its workers, beside the engine's one process
driving every GPU. Each process reads the group from its environment (runtime/parallel/distributed.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

JOINED = "--joined"  # the flag a started process carries: it joins the group instead of starting one


def run_joined(n: int, argv: list[str], timeout_s: float = 1800) -> int:
    """Runs `python argv... --joined` n times, joined; the largest exit status. Every process is killed if any
    outlives timeout_s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cpu = "cpu" in os.environ.get("JAX_PLATFORMS", "")
    procs = []
    try:
        for i in range(n):
            env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n))
            env.update(JAX_PROCESS_ID=str(i), **({} if cpu else {"JAX_LOCAL_DEVICE_IDS": str(i)}))
            procs.append(subprocess.Popen([sys.executable, *argv, JOINED], env=env))
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max(p.returncode for p in procs)


def join(timeout_s: int = 120) -> None:
    """In a started process: joins the group (before any JAX computation)."""
    from capstan.runtime.parallel.distributed import initialize_from_env

    initialize_from_env(timeout_s=timeout_s)
