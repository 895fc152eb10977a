"""On a real control plane, in a namespace that enforces the `restricted` Pod Security Standard: the API server
admits the operator's pods (kwok then runs them on the fake GPU nodes) and refuses the same InferenceService whose
securityContext a podTemplate override removes, which the status reports as Degraded/PodsRejected."""

from __future__ import annotations

import pytest
import yaml
from control_plane import wait_for

pytestmark = pytest.mark.cluster
RESTRICTED = "pod-security.kubernetes.io/enforce=restricted"


def isvc_manifest(name: str, **spec) -> str:
    spec = {
        "model": {"uri": "gs://bucket/qwen3"},  # the rclone init container too
        "accelerator": {"type": "nvidia-l4"},
        **spec,
    }
    return yaml.safe_dump(
        {
            "apiVersion": "serving.capstan.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


def condition(resource: dict, type_: str) -> dict:
    return next((c for c in resource.get("status", {}).get("conditions", []) if c["type"] == type_), {})


@pytest.fixture
def restricted_namespace(cluster, namespace):
    cluster.kubectl("label", "namespace", namespace, RESTRICTED, "pod-security.kubernetes.io/enforce-version=latest")
    return namespace


def test_restricted_namespace_admits_the_rendered_pods(cluster, operator, restricted_namespace):
    ns = restricted_namespace
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=isvc_manifest("safe"))

    def running():
        pods = cluster.get_json("pods", "-n", ns, "-l", "serving.capstan.dev/inferenceservice=safe")["items"]
        return pods if pods and all(p["status"].get("phase") == "Running" for p in pods) else None

    (pod,) = wait_for("the pod admitted and running", running, 90, interval=0.5)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["initContainers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    isvc = cluster.get_json("inferenceservice", "safe", "-n", ns)
    assert condition(isvc, "Degraded").get("reason") != "PodsRejected", isvc["status"]


def test_restricted_namespace_refuses_pods_without_the_security_context(cluster, operator, restricted_namespace):
    ns = restricted_namespace
    cluster.kubectl(
        "apply",
        "-n",
        ns,
        "-f",
        "-",
        input=isvc_manifest(
            "unsafe",
            podTemplate={"spec": {"securityContext": {}, "containers": [{"name": "capstan", "securityContext": {}}]}},
        ),
    )

    def rejected():
        isvc = cluster.get_json("inferenceservice", "unsafe", "-n", ns)
        degraded = condition(isvc, "Degraded")
        return degraded if degraded.get("reason") == "PodsRejected" else None

    degraded = wait_for("the status to report the refused pods", rejected, 90, interval=0.5)
    assert degraded["status"] == "True"
    assert 'violates PodSecurity "restricted:latest"' in degraded["message"], degraded
    assert "runAsNonRoot" in degraded["message"] and "seccompProfile" in degraded["message"], degraded
    assert not cluster.get_json("pods", "-n", ns, "-l", "serving.capstan.dev/inferenceservice=unsafe")["items"]
