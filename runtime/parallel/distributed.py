"""Several hosts as one JAX program: each host's process joins the jax.distributed group its environment names,
before any JAX computation; the engine then runs in lockstep on every host (engine/lockstep.py).

The operator sets JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID;
JAX_LOCAL_DEVICE_IDS (comma-separated) gives a process only some of its host's GPUs: several processes on one host,
one a GPU (benchmarks/all_reduce.py --processes)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("capstan.multihost")
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_from_env(timeout_s: int = 300) -> bool:
    """Joins the host group the environment names (before any JAX computation); False when there is none."""
    if int(os.environ.get("JAX_NUM_PROCESSES", "1")) <= 1:
        return False
    missing = [name for name in ENV if not os.environ.get(name)]
    if missing:
        raise ValueError(f"JAX_NUM_PROCESSES={os.environ['JAX_NUM_PROCESSES']} needs {', '.join(missing)} as well")
    local = os.environ.get("JAX_LOCAL_DEVICE_IDS", "").strip()
    try:
        local_ids = [int(i) for i in local.split(",")] if local else None
    except ValueError:
        raise ValueError(f"JAX_LOCAL_DEVICE_IDS={local!r}: not comma-separated device numbers") from None
    import jax  # only with several hosts: one host's `capstan serve` starts its engine cores before importing JAX

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts' collectives across processes
    jax.distributed.initialize(
        os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
        local_device_ids=local_ids,
        initialization_timeout=timeout_s,
    )
    log.info(
        "process %d of %d; devices: %d here, %d in all",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True
