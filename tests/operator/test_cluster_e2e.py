"""End to end on a real control plane: helm install, apply an InferenceService, watch the operator
(running under the chart's ServiceAccount) create, roll, report, survive restarts and clean up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from control_plane import wait_for
from operator_process import OperatorProcess

pytestmark = pytest.mark.cluster
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def eventually(what, check, timeout=90.0):
    return wait_for(what, check, timeout=timeout, interval=0.5)


def isvc_manifest(name: str, **spec) -> str:
    spec.setdefault("model", {"uri": "hf://Qwen/Qwen3-0.6B"})
    return yaml.safe_dump(
        {
            "apiVersion": "serving.capstan.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


def get(cluster, namespace, *what):
    return cluster.get_json(*what, "-n", namespace)


def condition(isvc, type_):
    return next((c for c in isvc.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def owned(cluster, namespace, kind):
    return get(cluster, namespace, kind, "-l", "serving.capstan.dev/inferenceservice")["items"]


def test_helm_lint_is_clean(cluster):
    result = cluster.helm("lint", "--strict", str(Path(__file__).resolve().parents[2] / "charts" / "capstan"))
    assert "0 chart(s) failed" in result.stdout


def test_examples_are_accepted_by_the_api_server(cluster, chart, namespace):
    """Every document of every example, but the Gateway API's (no Gateway implementation here: the HTTPRoute of
    qwen3-inference-pool.yaml is checked against the InferencePool it routes to by test_inference_pool_render.py)."""
    for example in sorted(EXAMPLES.glob("*.yaml")):
        for document in yaml.safe_load_all(example.read_text()):
            if not document["apiVersion"].startswith("gateway.networking.k8s.io/"):
                cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(document))


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ({"replicas": -1}, "spec.replicas", "greater than or equal to 0"),
        ({"minReplicas": 5, "maxReplicas": 2}, "spec.minReplicas", "less than or equal to spec.maxReplicas"),
        ({"accelerator": {"type": "nvidia-rtx-9090"}}, "spec.accelerator.type", "Unsupported value"),
        ({"model": {"uri": "http://example.com/llama"}}, "spec.model.uri", "should match"),
        ({"accelerator": {"type": "tpu-v5e", "count": 4}}, "spec.accelerator.topology", "required for TPU"),
        ({"autoscaling": {"target": 8}}, "spec.maxReplicas", "required when spec.autoscaling is set"),
        ({"replica": 2}, "spec.replica", "unknown field"),
    ],
)
def test_api_server_refuses_nonsense_naming_the_field(cluster, chart, namespace, spec, field, words):
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc_manifest("bad", **spec), check=False)
    assert result.returncode != 0, f"accepted: {spec}"
    assert field in result.stderr and words in result.stderr, result.stderr


def test_api_server_refuses_a_name_that_cannot_name_a_service(cluster, chart, namespace):
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc_manifest("7b-model"), check=False)
    assert result.returncode != 0 and "metadata.name must be a DNS label" in result.stderr, result.stderr


def test_inference_service_lifecycle(cluster, operator, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "qwen3-l4.yaml"))
    isvc = get(cluster, namespace, "inferenceservice", "qwen3")

    # The owned objects, with the fields that matter.
    deployment = eventually("the Deployment", lambda: get(cluster, namespace, "deployment", "qwen3"))
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["capstan", "serve"]
    assert container["args"][:1] == ["hf://Qwen/Qwen3-0.6B"] and "--max-model-len" in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    service = eventually("the Service", lambda: get(cluster, namespace, "service", "qwen3"))
    assert service["spec"]["ports"][0]["port"] == 80 and service["spec"]["ports"][0]["targetPort"] == "http"
    eventually("the PodDisruptionBudget", lambda: get(cluster, namespace, "pdb", "qwen3"))

    # Pods land on the GPU nodes and kwok makes them ready; the status says so.
    def ready_isvc():
        current = get(cluster, namespace, "inferenceservice", "qwen3")
        return (
            current
            if condition(current, "Ready").get("status") == "True" and current["status"].get("readyReplicas") == 2
            else None
        )

    isvc = eventually("InferenceService Ready", ready_isvc)
    assert isvc["status"]["url"] == f"http://qwen3.{namespace}.svc.cluster.local/v1"
    assert isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]
    assert condition(isvc, "Degraded")["status"] == "False"
    pods = owned(cluster, namespace, "pods")
    assert len(pods) == 2 and all(p["spec"]["nodeName"].startswith("gpu-l4-") for p in pods)
    table = cluster.kubectl("get", "csvc", "-n", namespace).stdout
    assert "hf://Qwen/Qwen3-0.6B" in table and isvc["status"]["url"] in table
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceService", "-o", "json"
    ).stdout
    assert "Serving" in events and "Applied" in events

    # A spec change rolls the pods without losing capacity.
    cluster.kubectl(
        "patch",
        "csvc",
        "qwen3",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"runtime": {"maxModelLen": 4096}}}),
    )
    available_seen = []

    def rolled():
        current = get(cluster, namespace, "inferenceservice", "qwen3")
        dep = get(cluster, namespace, "deployment", "qwen3")
        available_seen.append(dep["status"].get("availableReplicas", 0))
        pod_args = [p["spec"]["containers"][0]["args"] for p in owned(cluster, namespace, "pods")]
        return (
            current["status"]["observedGeneration"] == current["metadata"]["generation"] == 2
            and condition(current, "Progressing").get("reason") == "Complete"
            and len(pod_args) == 2
            and all("4096" in args for args in pod_args)
        )

    eventually("the rollout of the new spec", rolled)
    assert min(available_seen) >= 2, available_seen
    assert len(owned(cluster, namespace, "replicasets")) == 2  # old one kept at 0 for rollback

    # Kill the operator mid-change; its successor converges, with no duplicate objects.
    cluster.kubectl("scale", "csvc/qwen3", "-n", namespace, "--replicas=3")  # the scale subresource
    operator.kill()
    operator.start()
    eventually(
        "3 ready replicas after the restart",
        lambda: get(cluster, namespace, "inferenceservice", "qwen3")["status"].get("readyReplicas") == 3,
    )
    for kind in ("deployments", "services", "poddisruptionbudgets"):
        assert len(owned(cluster, namespace, kind)) == 1, kind
    assert len(owned(cluster, namespace, "pods")) == 3

    # Level-triggered: an owned object deleted by hand comes back.
    uid = get(cluster, namespace, "service", "qwen3")["metadata"]["uid"]
    cluster.kubectl("delete", "service", "qwen3", "-n", namespace)
    eventually("the Service recreated", lambda: get(cluster, namespace, "service", "qwen3")["metadata"]["uid"] != uid)

    # Deleting the InferenceService leaves nothing behind.
    cluster.kubectl("delete", "csvc", "qwen3", "-n", namespace, "--wait=true", timeout=60)

    def all_gone():
        return not any(
            owned(cluster, namespace, kind)
            for kind in ("deployments", "replicasets", "pods", "services", "poddisruptionbudgets")
        )

    eventually("garbage collection of everything the InferenceService owned", all_gone)


def _degraded(cluster, namespace, name):
    def check():
        current = get(cluster, namespace, "inferenceservice", name)
        return current if condition(current, "Degraded").get("status") == "True" else None

    return eventually(f"{name} Degraded", check)


def test_missing_accelerator_is_reported_as_degraded(cluster, operator, namespace):
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=isvc_manifest("big", accelerator={"type": "nvidia-h100", "count": 8})
    )
    isvc = _degraded(cluster, namespace, "big")
    degraded = condition(isvc, "Degraded")
    assert degraded["reason"] == "AcceleratorUnavailable"
    assert "nvidia-h100" in degraded["message"]
    assert condition(isvc, "Ready")["status"] == "False"
    warnings = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "type=Warning").stdout
    assert "AcceleratorUnavailable" in warnings


@pytest.mark.parametrize(
    ("image", "reason"),
    [
        ("registry.invalid/capstan:unpullable", "ImagePullFailed"),
        ("registry.invalid/capstan:crashing", "CrashLoop"),
    ],
)
def test_pod_failures_are_reported_as_degraded(cluster, operator, namespace, image, reason):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc_manifest("failing", image=image))
    degraded = condition(_degraded(cluster, namespace, "failing"), "Degraded")
    assert degraded["reason"] == reason
    assert ("capstan" in degraded["message"]) and (image in degraded["message"] or "exit code 1" in degraded["message"])


def test_a_pod_template_the_api_server_refuses_is_reported(cluster, operator, namespace):
    manifest = isvc_manifest("override", podTemplate={"spec": {"restartPolicy": "Never"}})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
    degraded = condition(_degraded(cluster, namespace, "override"), "Degraded")
    assert degraded["reason"] == "InvalidPodTemplate" and "restartPolicy" in degraded["message"]


def test_a_second_operator_replica_stands_by_until_the_first_goes(
    cluster, operator, operator_kubeconfig, namespace, tmp_path
):
    """kopf peering: replicas start paused; only the highest priority acts, the next takes over."""
    standby = OperatorProcess(operator_kubeconfig, tmp_path).start("--priority=1")  # below start-time priorities
    try:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc_manifest("one", replicas=1))
        eventually(
            "the active operator serving",
            lambda: condition(get(cluster, namespace, "inferenceservice", "one"), "Ready").get("status") == "True",
        )
        assert "Resuming operations" not in standby.log.read_text()
        assert "on_change" not in standby.log.read_text()  # no handler ran in the standby

        operator.stop()  # a graceful exit takes it out of the peering object
        # Up to kopf's peer lifetime (60 s): an operator killed earlier in the session still counts until it expires.
        eventually("the standby taking over", lambda: "Resuming operations" in standby.log.read_text(), timeout=150)
        cluster.kubectl("patch", "csvc", "one", "-n", namespace, "--type=merge", "-p", '{"spec": {"replicas": 2}}')
        eventually(
            "the former standby acting on a change",
            lambda: get(cluster, namespace, "inferenceservice", "one")["status"].get("readyReplicas") == 2,
        )
    finally:
        standby.stop()
        operator.start()


def test_chart_can_be_limited_to_namespaces(cluster):
    rendered = cluster.helm(
        "template",
        "capstan",
        str(Path(__file__).resolve().parents[2] / "charts" / "capstan"),
        "--namespace",
        "ops",
        "--set",
        "watchNamespaces={team-a,team-b}",
    ).stdout
    documents = [d for d in yaml.safe_load_all(rendered) if d]
    kinds = {(d["kind"], d["metadata"].get("namespace")) for d in documents}
    assert {("Role", "team-a"), ("RoleBinding", "team-b"), ("KopfPeering", "team-a")} <= kinds
    assert not any(d["kind"] in ("ClusterRole", "ClusterRoleBinding") for d in documents)
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert {"--namespace=team-a", "--namespace=team-b"} <= set(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
