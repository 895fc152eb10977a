"""Real processes for the gateway tests and benchmark: `capstan serve` replicas of the embedded tiny model and
`capstan gateway` in front of them, each in its own process group, on free ports of 127.0.0.1. Every wait has
a timeout; every process is killed on the way out."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import httpx

from capstan.runtime.config import DEFAULT_MODEL

START_TIMEOUT = 420  # seconds: weights and CPU compilation of the tiny model on a busy 2-core machine (cold: minutes)
REPLICA_FLAGS = ["--max-num-seqs", "4", "--max-model-len", "1024", "--max-num-batched-tokens", "128"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A `capstan` subcommand; its output goes to a temporary file, shown when it fails to start."""

    def __init__(self, args: list[str], port: int, host: str = "127.0.0.1"):
        self.port = port
        self.url = f"http://{host}:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="capstan-gateway-test-", suffix=".log", delete=False)  # noqa: SIM115 - open until stop(): the gateway writes it
        # its own temporary files (a server's sockets' folder), removed once it exits: a SIGKILL skips its cleanup
        self.tmpdir = tempfile.mkdtemp(prefix="capstan-test-")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "capstan.runtime.cli", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": self.tmpdir},
        )

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Process:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode} before it was ready:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} not ready within {timeout} s:\n{self.output()}")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        if os.path.exists(self.log.name):  # stopped twice (a test, then its fixture): once is enough
            os.unlink(self.log.name)


def start_replica(
    name: str = "tiny", port: int | None = None, extra: Sequence[str] = (), host: str = "127.0.0.1"
) -> Process:
    port = port or free_port()
    return Process(
        [
            "serve",
            str(DEFAULT_MODEL),
            "--host",
            host,
            "--port",
            str(port),
            "--served-model-name",
            name,
            "--drain-timeout",
            "1",
            *REPLICA_FLAGS,
            *extra,
        ],
        port,
        host,
    )


def ready_all(starts: Sequence[Callable[[], Process]], attempts: int = 3) -> list[Process]:
    """Starts every process, then waits for each; one that exits because a port it was given had been taken since
    free_port() chose it (any connection's ephemeral port can take it meanwhile: CI saw ZeroMQ's bind refused) is
    started again, on the ports its start() chooses anew. On any other failure every one is stopped."""
    procs = [start() for start in starts]
    try:
        for i, start in enumerate(starts):
            for attempt in range(attempts):
                try:
                    procs[i].wait_ready()
                    break
                except RuntimeError as e:
                    procs[i].stop()
                    if "Address already in use" not in str(e) or attempt == attempts - 1:
                        raise
                    procs[i] = start()
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def start_gateway(replicas: list[str], *flags: str) -> Process:
    port = free_port()
    args = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags]
    for replica in replicas:
        args += ["--replica", replica]
    return Process(args, port)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
