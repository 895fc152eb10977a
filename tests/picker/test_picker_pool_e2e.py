"""`capstan picker --pool-name` on the real control plane (tests/cluster: kube-apiserver, kwok's fake kubelets), with
the GIE's vendored InferencePool CRD applied and a ServiceAccount that may only read pods and inferencepools (what
the operator's picker Role grants): the picker finds the pool's ready pods by its selector and target port, follows
pods that come and go (a list, then a watch) and a selector that changes, and takes its failure mode from the pool's endpointPickerRef. kwok's pods serve nothing, so
they are never ready by the picker's probes: FailOpen sends requests to them anyway, FailClose answers 503."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "cluster"))

from binaries import ensure_binaries  # noqa: E402
from control_plane import ControlPlane, wait_for, write_kubeconfig  # noqa: E402
from envoy_client import route, subset_metadata  # noqa: E402
from picker_process import start_picker  # noqa: E402

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "gateway-api-inference-extension" / "inference.networking.k8s.io_inferencepools.yaml"
COMPLETION = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
TIMEOUT = 60  # seconds, each wait: pods scheduled and made ready by kwok, the picker's next poll


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    control_plane = ControlPlane(ensure_binaries(), tmp_path_factory.mktemp("cluster"))
    try:
        yield control_plane.start()
    finally:
        control_plane.stop()


def pod(name: str, labels: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": "cpu-0", "containers": [{"name": "server", "image": "capstan:test"}]},
    }


def pool(mode: str, app: str = "tiny") -> dict:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "tiny"},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "tiny-picker", "port": {"number": 9002}, "failureMode": mode},
        },
    }


def picker_kubeconfig(cluster, namespace: str, folder: Path) -> Path:
    """A token of a ServiceAccount that may get, list and watch pods and inferencepools in `namespace`, only."""
    read = ["get", "list", "watch"]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "picker"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": read},
            {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": read},
        ],
    }
    cluster.kubectl("create", "serviceaccount", "picker", "-n", namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(role))
    cluster.kubectl(
        "create", "rolebinding", "picker", "-n", namespace, "--role=picker", f"--serviceaccount={namespace}:picker"
    )
    token = cluster.kubectl("create", "token", "picker", "-n", namespace, "--duration=1h").stdout.strip()
    user = f"system:serviceaccount:{namespace}:picker"
    return write_kubeconfig(folder / "kubeconfig", cluster.server, cluster.ca_cert, token, user)


def pod_ips(cluster, namespace: str, selector: str) -> set[str]:
    pods = cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]
    ready = [
        p
        for p in pods
        if any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
    ]
    return {p["status"]["podIP"] for p in ready if p["status"].get("podIP")}


def test_the_picker_follows_its_pool(cluster, tmp_path, monkeypatch):
    ns = f"picker-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/inferencepools.inference.networking.k8s.io")
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pool("FailOpen")))
    for name, labels in [("tiny-0", {"app": "tiny"}), ("tiny-1", {"app": "tiny"}), ("other", {"app": "other"})]:
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod(name, labels)))
    wait_for("kwok's pods ready", lambda: len(pod_ips(cluster, ns, "app in (tiny, other)")) == 3, TIMEOUT)
    selected = {f"{ip}:8000" for ip in pod_ips(cluster, ns, "app=tiny")}
    monkeypatch.setenv("KUBECONFIG", str(picker_kubeconfig(cluster, ns, tmp_path)))
    picker = start_picker("--pool-name", "tiny", "--pool-namespace", ns)
    try:
        picker.wait_ready()
        with grpc.insecure_channel(picker.target) as channel:
            picked = {route(channel, "/v1/completions", COMPLETION).endpoint for _ in range(4)}
            assert picked and picked <= selected  # the pool's pods, on its target port; never `other`
            cluster.kubectl("delete", "pod", "tiny-0", "-n", ns, "--wait=true", "--grace-period=0", "--force")
            (remaining,) = {f"{ip}:8000" for ip in pod_ips(cluster, ns, "app=tiny")}
            wait_for(
                "the picker dropping the deleted pod",
                lambda: route(channel, "/v1/completions", COMPLETION).endpoint == remaining,
                TIMEOUT,
            )
            # A pod that comes later is seen (the watch): asked for by the subset hint, it is picked.
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod("tiny-2", {"app": "tiny"})))
            wait_for("tiny-2 ready", lambda: len(pod_ips(cluster, ns, "app=tiny")) == 2, TIMEOUT)
            (late,) = {f"{ip}:8000" for ip in pod_ips(cluster, ns, "app=tiny")} - {remaining}
            wait_for(
                "the picker seeing the new pod",
                lambda: (
                    route(channel, "/v1/completions", COMPLETION, metadata=subset_metadata([late])).endpoint == late
                ),
                TIMEOUT,
            )
            # The pool's selector changes: its pods change with it.
            other = f"{pod_ips(cluster, ns, 'app=other').pop()}:8000"
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pool("FailOpen", app="other")))
            wait_for(
                "the picker following the new selector",
                lambda: route(channel, "/v1/completions", COMPLETION).endpoint == other,
                TIMEOUT,
            )
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pool("FailClose")))
            deadline = time.monotonic() + TIMEOUT
            while route(channel, "/v1/completions", COMPLETION).status != 503:
                assert time.monotonic() < deadline, "the picker never took the pool's FailClose"
                time.sleep(0.25)
    finally:
        picker.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
