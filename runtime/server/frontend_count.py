"""How many frontend processes `capstan serve --api-server-count auto` (the default) runs, and the operator renders
for its pods: from the CPUs the process may use and whether an accelerator does the model's work. No JAX here: the
serving process and the operator decide without starting a backend.

On a CPU-only host the engine's matmuls need every core: one frontend. Beside a GPU or TPU the engine core uses
about one core, and HTTP, tokenization, detokenization and SSE for hundreds of streams are the bottleneck: one H200
with 16 cores, 256 streams, served 0.73x the offline engine's tokens/s with one frontend, 0.99x with 4, 0.93x with
8 (benchmarks/RESULTS.md): one frontend per 4 CPUs, at most 4."""

from __future__ import annotations

import glob
import importlib.util
import math
import os
from pathlib import Path

CPUS_PER_FRONTEND = 4
MAX_FRONTENDS = 4


def frontends_for(cpus: float, accelerator: bool) -> int:
    if not accelerator:
        return 1
    return max(1, min(MAX_FRONTENDS, int(cpus // CPUS_PER_FRONTEND)))


def host_cpus() -> float:
    """CPUs this process may use: its affinity, bounded by its cgroup's CPU limit (a pod's limits.cpu)."""
    cpus = float(len(os.sched_getaffinity(0)))
    quota = _cgroup_cpu_limit()
    return min(cpus, quota) if quota is not None else cpus


def _cgroup_cpu_limit() -> float | None:
    try:  # cgroup v2: "max 100000" or "400000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1: -1 is no limit
        v1_quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        v1_period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if v1_quota <= 0 else v1_quota / v1_period
    except (OSError, ValueError):
        return None


def host_has_accelerator() -> bool:
    """An NVIDIA GPU or a TPU is visible to JAX here (JAX_PLATFORMS=cpu, or no such device: no)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and all(p.strip() == "cpu" for p in platforms.split(",")):
        return False
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1") and not glob.glob("/dev/accel[0-9]*"):
        return False
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    # TPU chips: /dev/accel* (v4 and later) or /dev/vfio/* (v5e, v6e), where libtpu (the TPU image's) is installed
    tpu_devices = glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
    return bool(tpu_devices) and importlib.util.find_spec("libtpu") is not None


def cpu_quantity(text: str | int | float) -> float | None:
    """A Kubernetes CPU quantity ("500m", "4", 2.5) in CPUs; None when it is not one."""
    value = str(text).strip()
    try:
        cpus = float(value[:-1]) / 1000 if value.endswith("m") else float(value)
    except ValueError:
        return None
    return cpus if math.isfinite(cpus) and cpus >= 0 else None
