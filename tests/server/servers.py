"""Real servers for the server tests: uvicorn on a thread of the test process, and `capstan serve` as a
subprocess (for signals). Every wait has a timeout; every process is killed on the way out."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

CHECKPOINT = Path(__file__).parents[1] / "data" / "golden" / "qwen3-s13"
ENGINE_FLAGS = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128)
MODEL = "qwen3-s13"
API_KEYS = ["key-one", "key-two"]
START_TIMEOUT = 540  # seconds: weight loading plus CPU compilation on a busy 2-core machine (SmolLM2 cold: ~300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = START_TIMEOUT, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout} s")


def child_processes(pid: int) -> dict[int, str]:
    """The live children of a process, by pid, with their command lines (from /proc)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:  # it exited while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z":
            children[int(entry.name)] = cmdline
    return children


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


class ThreadServer:
    """uvicorn serving an app on a thread of this process (no signal handling: the main thread owns that)."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=2)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_ready(self.url)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ServeProcess:
    """`capstan serve` as a user runs it, in its own process group so it can be signalled and cleaned up."""

    def __init__(
        self, *flags: str, env: dict | None = None, model: Path | None = CHECKPOINT, engine_flags: dict = ENGINE_FLAGS
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model_arg = [str(model)] if model is not None else []  # None: the default model, as `capstan serve` alone
        command = [
            sys.executable,
            "-m",
            "capstan.runtime.cli",
            "serve",
            *model_arg,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *[f"--{k.replace('_', '-')}={v}" for k, v in engine_flags.items()],
            *flags,
        ]
        # the server's own temporary files (its sockets' folder), removed on the way out: a SIGKILL skips its cleanup
        self.tmpdir = tempfile.mkdtemp(prefix="capstan-test-serve-")
        self.process = subprocess.Popen(
            command,
            env={**os.environ, "TMPDIR": self.tmpdir, **(env or {})},
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None  # stdout=PIPE
        for line in self.process.stdout:
            self.output.append(line)

    def __enter__(self):
        try:
            wait_ready(self.url, process=self.process)
        except BaseException:
            self.__exit__()
            raise
        return self

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def __exit__(self, *exc):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self._reader.join(timeout=5)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
