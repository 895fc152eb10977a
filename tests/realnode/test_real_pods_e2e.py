"""End to end with real pods on a real node: the chart installed with this tree's image (so the operator runs
as a pod under the chart's ServiceAccount and RBAC), an InferenceService serving the embedded tiny model on
CPU through real probes, the openai client talking to it through its Service, and `kubectl delete` cleaning up."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml
from build import EMBEDDED_TINY_MODEL
from control_plane import wait_for
from streaming_load import StreamingLoad

OPERATOR_NAMESPACE = "capstan-system"  # the chart's, as conftest installs it

pytestmark = [pytest.mark.realnode, pytest.mark.slow]
SERVE_TIMEOUT = 600  # image layers unpacked, weights loaded, every step shape compiled, on a shared 2-core machine


def tiny_inference_service(
    name: str, compile_cache: Path, replicas: int = 1, extra_args: tuple[str, ...] = (), **spec
) -> str:
    """The embedded tiny checkpoint on CPU: its args replace the operator's, which would name a download, and
    its cache volume (XLA's compilation cache) is one folder of the node's, shared by every pod."""
    args = [
        EMBEDDED_TINY_MODEL,
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        "64",
        "--drain-timeout",
        str(spec.get("drainTimeoutSeconds", 30)),
        *extra_args,
    ]
    cache = {"name": "model-cache", "hostPath": {"path": str(compile_cache), "type": "Directory"}}
    body = {
        "model": {"uri": "hf://capstan/tiny-random", "servedName": "tiny"},
        "accelerator": {"type": "cpu"},
        "replicas": replicas,
        "startupTimeoutSeconds": SERVE_TIMEOUT,
        "podTemplate": {"spec": {"containers": [{"name": "capstan", "args": args}], "volumes": [cache]}},
        **spec,
    }
    return yaml.safe_dump(
        {
            "apiVersion": "serving.capstan.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": body,
        }
    )


def condition(resource: dict, type_: str) -> dict:
    return next((c for c in resource.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def pods_of(cluster, namespace: str, name: str) -> list[dict]:
    return cluster.get_json("pods", "-n", namespace, "-l", f"serving.capstan.dev/inferenceservice={name}")["items"]


def wait_serving(cluster, namespace: str, name: str, replicas: int) -> dict:
    def serving():
        isvc = cluster.get_json("inferenceservice", name, "-n", namespace)
        generation_seen = isvc["status"].get("observedGeneration") == isvc["metadata"]["generation"]
        return (
            isvc
            if generation_seen
            and condition(isvc, "Ready").get("status") == "True"
            and isvc["status"].get("readyReplicas") == replicas
            else None
        )

    try:
        return wait_for(f"{name} serving with {replicas} ready replicas", serving, SERVE_TIMEOUT, interval=2)
    except TimeoutError:
        for pod in pods_of(cluster, namespace, name):
            print(cluster.kubectl("logs", "-n", namespace, pod["metadata"]["name"], "--tail=40", check=False).stdout)
        raise


def service_url(cluster, namespace: str, name: str) -> str:
    """The OpenAI base URL on the Service's cluster IP, as a pod in the cluster would use it."""
    return f"http://{cluster.get_json('service', name, '-n', namespace)['spec']['clusterIP']}/v1"


@pytest.fixture
def namespace(real_cluster):
    name = "real-pods"
    real_cluster.kubectl("create", "namespace", name)
    wait_for(
        "the namespace's default service account",
        lambda: real_cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        60,
    )
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=true", check=False, timeout=180)


def test_the_chart_runs_the_operator_as_a_real_pod(real_cluster, chart):
    (pod,) = real_cluster.get_json("pods", "-n", "capstan-system", "-l", "app.kubernetes.io/name=capstan-operator")[
        "items"
    ]
    assert pod["spec"]["nodeName"] == "capstan-node" and pod["spec"]["serviceAccountName"] == chart
    assert pod["status"]["containerStatuses"][0]["ready"], pod["status"]
    (gateway,) = real_cluster.get_json("pods", "-n", "capstan-system", "-l", "app.kubernetes.io/name=capstan-gateway")[
        "items"
    ]
    assert gateway["spec"]["nodeName"] == "capstan-node" and gateway["status"]["containerStatuses"][0]["ready"]


def test_an_inference_service_serves_through_its_service(real_cluster, chart, namespace, compile_cache):
    autoscaling = {"minReplicas": 1, "maxReplicas": 2, "autoscaling": {"target": 2}}
    real_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=tiny_inference_service("tiny", compile_cache, **autoscaling)
    )
    isvc = wait_serving(real_cluster, namespace, "tiny", replicas=1)
    # the chart's gateway routes for every InferenceService: status.url is through it
    assert isvc["status"]["url"] == f"http://capstan-gateway.{OPERATOR_NAMESPACE}.svc.cluster.local/v1"

    (pod,) = pods_of(real_cluster, namespace, "tiny")
    status = pod["status"]["containerStatuses"][0]
    assert pod["spec"]["nodeName"] == "capstan-node" and status["started"] and status["ready"], status
    assert status["restartCount"] == 0, real_cluster.kubectl(
        "logs", "-n", namespace, pod["metadata"]["name"], "--previous", check=False
    ).stdout

    base_url = service_url(real_cluster, namespace, "tiny")
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)  # every failure counts
    assert [m.id for m in client.models.list().data] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt="The capstan turns", max_tokens=8, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 8
    assert completion.choices[0].text
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # The same through the gateway, a real pod too: it found the replica through its EndpointSlice.
    gateway = openai.OpenAI(
        base_url=service_url(real_cluster, OPERATOR_NAMESPACE, "capstan-gateway"),
        api_key="unused",
        max_retries=0,
        timeout=120,
    )
    routed = gateway.completions.create(model="tiny", prompt="The capstan turns", max_tokens=8, temperature=0)
    assert routed.choices[0].text == completion.choices[0].text  # greedy: the same replica's same answer

    # The pod's own metrics reach the operator's autoscaler, across the pod network.
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10) as response:
        assert b"capstan_" in response.read()

    def scaled_up():
        decision = (
            real_cluster.get_json("inferenceservice", "tiny", "-n", namespace)["status"]
            .get("autoscaling", {})
            .get("lastDecision", "")
        )
        return decision if decision.startswith("scale up 1 -> 2") else None

    with StreamingLoad(base_url, clients=8, max_tokens=64) as load:  # about 8 running requests, target 2
        decision = wait_for("the autoscaler scaling up on the pod's metrics", scaled_up, 90, interval=1)
    assert "concurrentRequests" in decision and not load.failures, (decision, load.failures[:3])

    real_cluster.kubectl("delete", "inferenceservice", "tiny", "-n", namespace, "--wait=true", timeout=120)

    def all_gone():
        owned = real_cluster.get_json("all", "-n", namespace, "-l", "serving.capstan.dev/inferenceservice=tiny")
        return not owned["items"]

    wait_for("every owned object and pod gone", all_gone, 120, interval=1)
    tasks = json.dumps(real_cluster.get_json("pods", "-n", namespace)["items"])
    assert "tiny" not in tasks
