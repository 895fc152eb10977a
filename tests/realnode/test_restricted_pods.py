"""Pod Security on a real node: in a namespace that enforces `restricted`, an InferenceService's pod is admitted,
runs as the image's user on a read-only root filesystem, becomes Ready and answers the openai client; the same
InferenceService with its securityContext removed is refused by the API server (so this test can fail), which
the status reports. The cache volume is a PVC (a hostPath PersistentVolume on the node's XLA cache folder): the
profile forbids hostPath volumes in pods, not the PersistentVolumes behind their claims."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
import yaml
from build import EMBEDDED_TINY_MODEL
from control_plane import wait_for
from test_real_pods_e2e import SERVE_TIMEOUT, condition, pods_of, service_url, wait_serving

pytestmark = [pytest.mark.realnode, pytest.mark.slow]
NAMESPACE = "restricted-pods"


def inference_service(name: str, claim: str, **pod_template) -> str:
    args = [
        EMBEDDED_TINY_MODEL,
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        name,
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        "64",
        "--drain-timeout",
        "5",
    ]
    pod_template.setdefault("containers", [])
    pod_template["containers"] = [{"name": "capstan", "args": args, **(pod_template["containers"] or [{}])[0]}]
    body = {
        "model": {"uri": "hf://capstan/tiny-random", "servedName": name},
        "accelerator": {"type": "cpu"},
        "replicas": 1,
        "startupTimeoutSeconds": SERVE_TIMEOUT,
        "modelCache": {"claimName": claim},
        "podTemplate": {"spec": pod_template},
    }
    return yaml.safe_dump(
        {
            "apiVersion": "serving.capstan.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": body,
        }
    )


@pytest.fixture
def restricted(real_cluster, compile_cache: Path):
    cluster = real_cluster
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl(
        "label",
        "namespace",
        NAMESPACE,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": "restricted-xla-cache"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(compile_cache)},
            "claimRef": {"namespace": NAMESPACE, "name": "xla-cache"},
        },
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "xla-cache"},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": "restricted-xla-cache",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(volume))
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(claim))
    wait_for(
        "the namespace's default service account",
        lambda: cluster.kubectl("get", "sa", "default", "-n", NAMESPACE, check=False).returncode == 0,
        60,
    )
    wait_for(
        "the cache claim bound",
        lambda: cluster.get_json("pvc", "xla-cache", "-n", NAMESPACE).get("status", {}).get("phase") == "Bound",
        60,
        interval=1,
    )
    yield NAMESPACE
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", check=False, timeout=180)
    cluster.kubectl("delete", "pv", "restricted-xla-cache", "--wait=false", check=False)


def wait_serving_or_crash(cluster, ns: str, name: str) -> None:
    """Ready within the startup timeout; a container that exits fails at once, with its last words (something it
    writes outside its volumes on the read-only root filesystem, for instance)."""
    deadline = time.monotonic() + SERVE_TIMEOUT - 60  # inside pytest's own timeout, so the logs are shown
    while time.monotonic() < deadline:
        pods = pods_of(cluster, ns, name)
        for pod in pods:
            for status in pod["status"].get("containerStatuses", []):
                assert status["restartCount"] == 0, cluster.kubectl(
                    "logs", "-n", ns, pod["metadata"]["name"], "--previous", "--tail=60", check=False
                ).stdout
        if pods and all(s.get("ready") for p in pods for s in p["status"].get("containerStatuses", [{}])):
            wait_serving(cluster, ns, name, replicas=1)
            return
        time.sleep(2)
    pytest.fail(
        f"{name} not ready within {SERVE_TIMEOUT - 60} s: "
        + "\n".join(
            cluster.kubectl("logs", "-n", ns, p["metadata"]["name"], "--tail=40", check=False).stdout
            for p in pods_of(cluster, ns, name)
        )
    )


def test_restricted_namespace_admits_and_serves_then_refuses_without_security_context(real_cluster, chart, restricted):
    cluster, ns = real_cluster, restricted
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=inference_service("safe", "xla-cache"))
    wait_serving_or_crash(cluster, ns, "safe")
    (pod,) = pods_of(cluster, ns, "safe")
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and status["restartCount"] == 0, status
    assert pod["spec"]["securityContext"]["runAsUser"] == 65532
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    client = openai.OpenAI(base_url=service_url(cluster, ns, "safe"), api_key="unused", max_retries=0, timeout=120)
    completion = client.completions.create(model="safe", prompt="The capstan turns", max_tokens=4, temperature=0)
    assert completion.usage.completion_tokens == 4

    # The same, with the securityContext the operator renders removed by an override: refused at admission.
    cluster.kubectl(
        "apply",
        "-n",
        ns,
        "-f",
        "-",
        input=inference_service("unsafe", "xla-cache", securityContext={}, containers=[{"securityContext": {}}]),
    )

    def rejected():
        degraded = condition(cluster.get_json("inferenceservice", "unsafe", "-n", ns), "Degraded")
        return degraded if degraded.get("reason") == "PodsRejected" else None

    degraded = wait_for("the refused pods reported", rejected, 120, interval=1)
    assert 'violates PodSecurity "restricted:latest"' in degraded["message"], degraded
    assert not pods_of(cluster, ns, "unsafe")
