"""`capstan-operator` as a local process for the cluster tests, authenticated as the chart's ServiceAccount."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from control_plane import free_port, stop_process_group, wait_for

RELEASE = "capstan"  # the chart names its ServiceAccount and peering object after the release: "capstan"


class OperatorProcess:
    """`capstan-operator` as a local process, authenticated as the chart's ServiceAccount."""

    def __init__(self, kubeconfig: Path, workdir: Path):
        self.kubeconfig, self.workdir = kubeconfig, workdir
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.workdir / f"operator-{self.starts}.log"

    def start(self, *extra_args: str) -> OperatorProcess:
        assert self.process is None, "already running"
        self.starts += 1
        port = free_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "capstan.operator.main",
                f"--peering-name={RELEASE}",
                "--resync-seconds=1",
                f"--liveness=http://127.0.0.1:{port}/healthz",
                "--default-image=capstan:e2e",
                *extra_args,
            ],
            env=env,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def live():
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                return response.status == 200

        wait_for("operator liveness", live, timeout=60, process_log=self.log)
        return self

    def stop(self) -> None:
        if self.process is None:
            return
        stop_process_group(self.process, timeout=20)
        self.process = None

    def kill(self) -> None:
        """An abrupt stop (no cleanup), as when a node dies under the operator's pod."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None

    def restart(self, *extra_args: str) -> OperatorProcess:
        self.stop()
        return self.start(*extra_args)

    @contextlib.contextmanager
    def reading_pods_at(self, *addresses: str) -> Iterator[OperatorProcess]:
        """Restarted to read its pods' servers at these addresses (test-only --test-pod-addresses), then as before."""
        self.restart(f"--test-pod-addresses={','.join(addresses)}")
        try:
            yield self
        finally:
            self.restart()
