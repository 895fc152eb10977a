"""spec.inferencePool on the real control plane, in a namespace that enforces the `restricted` Pod Security level,
with the operator under the chart's RBAC: the example's InferenceService first in a cluster without the Gateway API
Inference Extension's CRD (the status says so; the serving pods run), then with the vendored CRD, as the chart renders
it, applied to the API server: the InferencePool and the picker's Deployment, Service, ServiceAccount, Role and
RoleBinding appear with the right fields, the picker's pods are admitted and (kwok's kubelet) ready, and the status
reports them. Turned off, the operator removes them. (Deleting the InferenceService leaves their removal to the
garbage collector, through the owner references checked here, as test_cluster_e2e.py proves for the serving objects;
on a fresh test cluster the collector watches a new CRD's kinds only from its next discovery sync, up to 30 s later,
which this test does not wait for.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from control_plane import wait_for

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "capstan"
CRD_TEMPLATE = "templates/inferencepool-crd.yaml"
CRD_NAME = "inferencepools.inference.networking.k8s.io"
POOL = CRD_NAME  # kubectl's name for the resource, unambiguous
EXAMPLE = REPO / "docs" / "examples" / "qwen3-inference-pool.yaml"
RESTRICTED = "pod-security.kubernetes.io/enforce=restricted"
TIMEOUT = 30  # every wait below: the operator resyncs each second here


def eventually(what, check):
    return wait_for(what, check, timeout=TIMEOUT, interval=0.5)


def pool_condition(cluster, namespace) -> dict:
    isvc = cluster.get_json("inferenceservice", "qwen3", "-n", namespace)
    return next((c for c in isvc.get("status", {}).get("conditions", []) if c["type"] == "InferencePoolReady"), {})


def exists(cluster, namespace, kind, name) -> bool:
    return cluster.kubectl("get", kind, name, "-n", namespace, check=False).returncode == 0


@pytest.fixture
def without_pool_crd(cluster):
    """The cluster starts without the CRD, and is left without it."""
    cluster.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true", "--timeout=30s", timeout=40)
    yield
    cluster.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true", "--timeout=30s", timeout=40)


@pytest.fixture
def restricted_namespace(cluster, namespace):
    cluster.kubectl("label", "namespace", namespace, RESTRICTED, "pod-security.kubernetes.io/enforce-version=latest")
    return namespace


def test_inference_pool_and_picker_follow_the_crd_and_the_spec(
    cluster, operator, restricted_namespace, without_pool_crd
):
    ns = restricted_namespace
    service = next(
        yaml.safe_load_all(EXAMPLE.read_text())
    )  # the example's InferenceService (its HTTPRoute: no Gateway)
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service))

    # Without the CRD: a condition that says what to do, serving pods as usual, and no picker waiting on a pool.
    missing = eventually(
        "InferencePoolCRDMissing", lambda: pool_condition(cluster, ns).get("reason") == "InferencePoolCRDMissing"
    )
    condition = pool_condition(cluster, ns)
    assert missing and condition["status"] == "False"
    assert "inferencePool.installCRD=true" in condition["message"], condition
    assert exists(cluster, ns, "deployment", "qwen3")
    assert not exists(cluster, ns, "deployment", "qwen3-epp")

    # The CRD as the chart installs it with inferencePool.installCRD=true (the same as crds/'s copy).
    chart_crd = cluster.helm(
        "template", "capstan", str(CHART), "--set", "inferencePool.installCRD=true", "--show-only", CRD_TEMPLATE
    ).stdout
    cluster.kubectl("apply", "--server-side", "-f", "-", input=chart_crd)
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=30s", timeout=40)

    def picker_ready():
        condition = pool_condition(cluster, ns)
        return condition if condition.get("reason") == "PickerReady" else None

    condition = eventually("the picker ready", picker_ready)
    assert condition["status"] == "True", condition
    isvc = cluster.get_json("inferenceservice", "qwen3", "-n", ns)
    assert isvc["status"]["inferencePool"] == {
        "name": "qwen3",
        "picker": {"name": "qwen3-epp", "replicas": 1, "readyReplicas": 1},
    }
    uid = isvc["metadata"]["uid"]

    pool = cluster.get_json(POOL, "qwen3", "-n", ns)
    assert pool["spec"]["selector"]["matchLabels"] == {"serving.capstan.dev/inferenceservice": "qwen3"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    picker_ref = pool["spec"]["endpointPickerRef"]
    assert (picker_ref["name"], picker_ref["port"], picker_ref["failureMode"]) == (
        "qwen3-epp",
        {"number": 9002},
        "FailOpen",
    )
    assert picker_ref["kind"] == "Service"  # the CRD's default: the API server validated what the operator wrote

    deployment = cluster.get_json("deployment", "qwen3-epp", "-n", ns)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["capstan", "picker"]
    assert container["args"] == [
        "--pool-name",
        "qwen3",
        "--pool-namespace",
        ns,
        "--grpc-port",
        "9002",
        "--grpc-health-port",
        "9003",
        "--metrics-port",
        "9090",
        "--failure-mode",
        "FailOpen",
    ]
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert pod["serviceAccountName"] == "qwen3-epp"
    picker_service = cluster.get_json("service", "qwen3-epp", "-n", ns)
    ports = {p["name"]: p for p in picker_service["spec"]["ports"]}
    assert ports["grpc-ext-proc"]["port"] == 9002 and ports["grpc-ext-proc"]["appProtocol"] == "kubernetes.io/h2c"
    assert ports["http-metrics"]["port"] == 9090
    # The serving Service and status count serving pods only, never the picker's.
    serving = cluster.get_json("pods", "-n", ns, "-l", "serving.capstan.dev/inferenceservice=qwen3")["items"]
    assert serving and not [p for p in serving if p["metadata"]["name"].startswith("qwen3-epp")]
    for kind in ("inferencepool", "deployment", "service", "serviceaccount", "role", "rolebinding"):
        what = POOL if kind == "inferencepool" else kind
        obj = cluster.get_json(what, "qwen3" if kind == "inferencepool" else "qwen3-epp", "-n", ns)
        assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [uid], kind

    # The picker's identity may read exactly what it watches (the API server's own RBAC evaluation).
    account = f"system:serviceaccount:{ns}:qwen3-epp"
    for verb, resource, allowed in [
        ("watch", "pods", "yes"),
        ("list", POOL, "yes"),
        ("get", POOL, "yes"),
        ("list", "secrets", "no"),
        ("patch", POOL, "no"),
    ]:
        answer = cluster.kubectl("auth", "can-i", verb, resource, "-n", ns, f"--as={account}", check=False)
        assert answer.stdout.strip() == allowed, (verb, resource, answer.stdout, answer.stderr)

    # Turned off: the operator removes the pool and its picker, and their status.
    patch = {"spec": {"inferencePool": {"enabled": False}}}
    cluster.kubectl("patch", "inferenceservice", "qwen3", "-n", ns, "--type=merge", "-p", json.dumps(patch))
    eventually("the pool removed", lambda: not exists(cluster, ns, POOL, "qwen3"))
    for kind in ("deployment", "service", "serviceaccount", "role", "rolebinding"):
        eventually(f"the picker's {kind} removed", lambda kind=kind: not exists(cluster, ns, kind, "qwen3-epp"))
    eventually(
        "the pool's status removed",
        lambda: (
            "inferencePool" not in cluster.get_json("inferenceservice", "qwen3", "-n", ns)["status"]
            and not pool_condition(cluster, ns)
        ),
    )
