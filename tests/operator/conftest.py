"""Cluster fixtures: a real control plane (built from Go modules on first use), the Helm chart installed
into it, and `capstan-operator` running as a local process under the chart's ServiceAccount."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

from binaries import ensure_binaries  # noqa: E402
from control_plane import ControlPlane, free_port, wait_for, write_kubeconfig  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "capstan"
OPERATOR_NAMESPACE = "capstan-system"
RELEASE = "capstan"  # the chart names its ServiceAccount and peering object after the release: "capstan"


def pytest_collection_finish(session):
    """Build the cluster binaries before any test runs, outside the per-test timeout (once; then cached)."""
    if any(item.get_closest_marker("cluster") for item in session.items):
        ensure_binaries(log=lambda message: print(f"\n[capstan cluster] {message}", flush=True))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    control_plane = ControlPlane(ensure_binaries(), tmp_path_factory.mktemp("cluster"))
    try:
        yield control_plane.start()
    finally:
        control_plane.stop()


@pytest.fixture(scope="session")
def chart(cluster):
    """`helm install` the chart, as a user would."""
    cluster.helm("install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
                 "--set", "resyncSeconds=2", "--wait", "--timeout", "90s")
    return RELEASE


class OperatorProcess:
    """`capstan-operator` as a local process, authenticated as the chart's ServiceAccount."""

    def __init__(self, kubeconfig: Path, workdir: Path):
        self.kubeconfig, self.workdir = kubeconfig, workdir
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.workdir / f"operator-{self.starts}.log"

    def start(self, *extra_args: str) -> "OperatorProcess":
        assert self.process is None, "already running"
        self.starts += 1
        port = free_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "capstan.operator.main", f"--peering-name={RELEASE}", "--resync-seconds=1",
             f"--liveness=http://127.0.0.1:{port}/healthz", "--default-image=capstan:e2e", *extra_args],
            env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

        def live():
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                return response.status == 200

        wait_for("operator liveness", live, timeout=60, process_log=self.log)
        return self

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None

    def kill(self) -> None:
        """An abrupt stop (no cleanup), as when a node dies under the operator's pod."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None

    def restart(self, *extra_args: str) -> "OperatorProcess":
        self.stop()
        return self.start(*extra_args)


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster, chart, tmp_path_factory) -> Path:
    token = cluster.kubectl("create", "token", RELEASE, "-n", OPERATOR_NAMESPACE, "--duration=6h").stdout.strip()
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{RELEASE}"
    return write_kubeconfig(tmp_path_factory.mktemp("operator") / "kubeconfig", cluster.server, cluster.ca_cert,
                            token, user)


@pytest.fixture(scope="session")
def operator(operator_kubeconfig, tmp_path_factory):
    process = OperatorProcess(operator_kubeconfig, tmp_path_factory.mktemp("operator-logs"))
    try:
        yield process.start()
    finally:
        process.stop()


@pytest.fixture
def namespace(cluster):
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    wait_for("the namespace's default service account",
             lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0, 60)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
