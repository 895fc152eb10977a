"""Real-node fixtures: the control plane plus a real node (containerd, runc, CNI, kubelet, kube-proxy) in a
network namespace of its own, with Capstan's CPU image built (once; then cached) and imported into containerd."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "cluster"))
sys.path.insert(0, str(REPO / "image"))

from binaries import ensure_binaries  # noqa: E402
from build import build_image  # noqa: E402
from control_plane import ControlPlane  # noqa: E402
from node_network import create_node_network  # noqa: E402
from real_node import RealNode  # noqa: E402

CHART = REPO / "charts" / "capstan"
OPERATOR_NAMESPACE = "capstan-system"
RELEASE = "capstan"
NODE_TOOLS = ["containerd", "runc", "ctr", "nsenter", "iptables", "umoci", "skopeo", "mmdebstrap"]


def pytest_collection_finish(session):
    """Build the binaries and the image before any test runs, outside the per-test timeout (once; then cached)."""
    if any(item.get_closest_marker("realnode") for item in session.items) and os.geteuid() == 0:
        log = lambda message: print(f"\n[capstan real node] {message}", flush=True)  # noqa: E731
        try:
            ensure_binaries(log=log)
            build_image("cpu", log=log)
        except Exception as error:  # noqa: BLE001 - the fixture raises it again, failing those tests only
            log(f"preparing the real node failed: {error}")


@pytest.fixture(scope="session")
def image():
    """(OCI archive, image name) of this tree's CPU image."""
    return build_image("cpu")


@pytest.fixture(scope="session")
def real_node(image, tmp_path_factory):
    """The control plane and the real node beside it (the node knows its cluster and its network)."""
    if os.geteuid() != 0:
        pytest.skip("the real node needs root: network namespaces, mounts, containerd")
    missing = [tool for tool in NODE_TOOLS if not shutil.which(tool, path=os.environ["PATH"] + ":/usr/sbin:/sbin")]
    assert not missing, f"missing {', '.join(missing)}: run `make system-packages`"
    binaries = ensure_binaries()
    network = create_node_network()
    workdir = tmp_path_factory.mktemp("realnode")
    cluster = ControlPlane(
        binaries,
        workdir / "control-plane",
        address=network.host_ip,
        service_cidr=network.service_cidr,
        fake_nodes=False,
    )
    node = RealNode(binaries, cluster, network, workdir / "node")
    try:
        cluster.start()
        node.start([image[0]])
        yield node
    finally:
        try:
            node.stop()
        finally:
            cluster.stop()
            network.destroy()


@pytest.fixture(scope="session")
def real_cluster(real_node):
    return real_node.cluster


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> Path:
    """One XLA compilation cache for every tiny pod (a hostPath): a new pod under load skips compiling."""
    folder = tmp_path_factory.mktemp("xla-cache")
    folder.chmod(0o777)  # the image's user, 65532, writes it
    return folder


@pytest.fixture(scope="session")
def chart(real_cluster, image):
    """`helm install` the chart with the image this tree built: the operator runs as a real pod."""
    repository, tag = image[1].rsplit(":", 1)
    real_cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--set",
        f"image.repository={repository}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "resyncSeconds=2",
        "--wait",
        "--timeout",
        "180s",
        timeout=200,
    )
    yield RELEASE
    real_cluster.helm("uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait", "--timeout", "60s", timeout=90)
