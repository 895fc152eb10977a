"""The chart's optional PodMonitor, rendered by `helm template` (no cluster): off by default; when on, it selects
exactly the serving pods operator/render.py renders, on the port they name, at /metrics."""

from __future__ import annotations

from helm_chart import needs_helm, template

from capstan.operator import api, render

pytestmark = needs_helm


def pod_monitors(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "PodMonitor"]


def test_off_by_default():
    assert pod_monitors(template()) == []


def test_selects_the_rendered_serving_pods_on_their_metrics_port():
    (monitor,) = pod_monitors(template("--set", "podMonitor.enabled=true", "--set", "podMonitor.labels.release=kps"))
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == "capstan-system" and monitor["metadata"]["labels"]["release"] == "kps"
    spec = api.InferenceServiceSpec.model_validate({"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "image": "capstan:t"})
    pod = render.render_deployment(
        {"metadata": {"name": "qwen", "namespace": "serving", "uid": "1"}}, spec, replicas=1
    )["spec"]["template"]
    wanted = monitor["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = [p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_watched_namespaces_limit_the_monitor():
    (monitor,) = pod_monitors(template("--set", "podMonitor.enabled=true", "--set", "watchNamespaces={a,b}"))
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
