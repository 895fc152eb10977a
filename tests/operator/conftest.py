"""Cluster fixtures: a real control plane (built from Go modules on first use), the Helm chart installed
into it, and `capstan-operator` running as a local process under the chart's ServiceAccount."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

from binaries import ensure_binaries  # noqa: E402
from control_plane import ControlPlane, wait_for, write_kubeconfig  # noqa: E402
from operator_process import RELEASE, OperatorProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "capstan"
OPERATOR_NAMESPACE = "capstan-system"


def pytest_collection_finish(session):
    """Build the cluster binaries before any test runs, outside the per-test timeout (once; then cached)."""
    if any(item.get_closest_marker("cluster") for item in session.items):
        try:
            ensure_binaries(log=lambda message: print(f"\n[capstan cluster] {message}", flush=True))
        except Exception as error:  # noqa: BLE001 - the cluster fixture raises it again, failing those tests only
            print(f"\n[capstan cluster] building the test cluster failed: {error}", flush=True)


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
    cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--set",
        "resyncSeconds=2",
        "--wait",
        "--timeout",
        "90s",
    )
    return RELEASE


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster, chart, tmp_path_factory) -> Path:
    token = cluster.kubectl("create", "token", RELEASE, "-n", OPERATOR_NAMESPACE, "--duration=6h").stdout.strip()
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{RELEASE}"
    return write_kubeconfig(
        tmp_path_factory.mktemp("operator") / "kubeconfig", cluster.server, cluster.ca_cert, token, user
    )


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
    wait_for(
        "the namespace's default service account",
        lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        60,
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
