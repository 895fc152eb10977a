"""Where a load's CPU and GPU time went: the server's processes by role, the whole host, and each GPU's busy share.

    with Usage(server_session_id) as usage:
        ...  # the load
    print(usage.summary())  # {"cores": {"engine core": 0.93, "frontend": 3.1, ...}, "host_busy_cores": 21.4, ...}

CPU from /proc (Linux): each process of the server's session (`capstan serve` is started in a session of its own),
named by its command line, in cores (CPU seconds over the wall seconds); the host's busy cores from /proc/stat, so a
saturated host shows. GPU from `nvidia-smi` sampled every 100 ms when it is there (the share of time a kernel ran)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _role(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "core_process" in cmd:
        return "engine core"
    if "frontend_process" in cmd:
        return "frontend"
    if "capstan.runtime.cli" in cmd:
        return "frontend 0 (serving process)"
    return cmd.split(" ")[0].rsplit("/", 1)[-1] or "other"


def session_cpu(sid: int) -> dict[int, tuple[str, float]]:
    """Every process of session sid: pid -> (role, CPU seconds so far)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
        if int(fields[3]) != sid:  # session id
            continue
        out[int(entry)] = (_role(int(entry)), (int(fields[11]) + int(fields[12])) / TICKS)
    return out


def host_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU together."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


class Usage:
    def __init__(self, sid: int | None):
        self.sid = sid
        self.result: dict = {}

    def __enter__(self) -> Usage:
        self._gpu = None
        if shutil.which("nvidia-smi"):
            self._gpu = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        self._cpu0 = session_cpu(self.sid) if self.sid else {}
        self._host0, self._t0 = host_ticks(), time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self._t0
        busy, total = (b - a for a, b in zip(self._host0, host_ticks(), strict=True))
        cpu1 = session_cpu(self.sid) if self.sid else {}
        roles: dict[str, list[float]] = {}
        for pid, (role, seconds) in cpu1.items():
            roles.setdefault(role, []).append((seconds - self._cpu0.get(pid, (role, 0.0))[1]) / wall)
        self.result = {
            "wall_s": wall,
            "host_busy_cores": (os.cpu_count() or 1) * busy / total if total else None,
            "host_cores": os.cpu_count(),
            "server_cores": {role: [round(c, 2) for c in sorted(cs, reverse=True)] for role, cs in roles.items()},
        }
        if self._gpu is not None:
            self._gpu.terminate()
            samples: dict[str, list[float]] = {}
            for line in (self._gpu.communicate(timeout=10)[0] or "").splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) == 2 and parts[1].isdigit():
                    samples.setdefault(parts[0], []).append(float(parts[1]))
            self.result["gpu_busy_percent"] = {g: round(sum(s) / len(s), 1) for g, s in samples.items() if s}

    def line(self) -> str:
        r = self.result
        roles = "; ".join(f"{role} {'/'.join(f'{c:.2f}' for c in cs)}" for role, cs in r["server_cores"].items())
        gpu = ", ".join(f"GPU {g} {p:.0f}%" for g, p in r.get("gpu_busy_percent", {}).items())
        return f"host busy {r['host_busy_cores']:.1f} of {r['host_cores']} cores; server cores: {roles}; {gpu}"
