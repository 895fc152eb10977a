"""Pure: an InferenceService's spec.inferencePool -> its Gateway API Inference Extension objects.

An InferencePool (inference.networking.k8s.io/v1) names the serving pods and their port; a GIE-capable Gateway,
routing an HTTPRoute to the pool, asks the pool's endpoint picker (`capstan picker`, an Envoy ext_proc gRPC server)
which pod takes each request. The picker runs as its own Deployment behind a Service, under a ServiceAccount whose
Role lets it watch the pool and the pods. Its pods carry their own labels, never the serving pods' selector: the
InferenceService's Service, PodDisruptionBudget, status and autoscaler count serving pods only.
"""

from __future__ import annotations

import hashlib
from typing import Any

from capstan.operator import api, pod_security, render

POOL_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{POOL_GROUP}/v1"
POOL_KIND = "InferencePool"
PICKER_CONTAINER = "picker"
PICKER_LABEL = f"{api.GROUP}/endpoint-picker"
GRPC_PORT = 9002  # ext_proc, which the Gateway calls (GIE's conventional port)
HEALTH_PORT = 9003  # grpc.health.v1, for the kubelet's gRPC probes
METRICS_PORT = 9090
PICKER_RESOURCES = {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
PICKER_SUFFIX = "-epp"  # GIE's name for an endpoint picker's objects: POOL-epp


def pool_name(name: str) -> str:
    """The InferencePool is named like its InferenceService (a kind of its own: no clash with the Service)."""
    return name


def picker_name(name: str) -> str:
    """NAME-epp, shortened with a hash of NAME where that would pass the 63 characters of a Service's name."""
    if len(name) + len(PICKER_SUFFIX) <= 63:
        return name + PICKER_SUFFIX
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{name[: 63 - len(PICKER_SUFFIX) - 7].rstrip('-')}-{digest}{PICKER_SUFFIX}"


def picker_selector(name: str) -> dict[str, str]:
    return {PICKER_LABEL: name}


def picker_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "capstan-picker",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "endpoint-picker",
        "app.kubernetes.io/managed-by": "capstan-operator",
        **picker_selector(name),
    }


def _metadata(owner: dict[str, Any], object_name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": object_name,
        "namespace": owner["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [render.owner_reference(owner)],
    }


def picker_args(pool: str, namespace: str, failure_mode: str) -> list[str]:
    """`capstan picker`'s flags (runtime/picker/)."""
    return [
        "--pool-name",
        pool,
        "--pool-namespace",
        namespace,
        "--grpc-port",
        str(GRPC_PORT),
        "--grpc-health-port",
        str(HEALTH_PORT),
        "--metrics-port",
        str(METRICS_PORT),
        "--failure-mode",
        failure_mode,
    ]


def render_inference_pool(
    owner: dict[str, Any], spec: api.InferenceServiceSpec, pod_selector: dict[str, str]
) -> dict[str, Any]:
    """pod_selector: the serving pods that take requests (a multi-host replica's leaders only), as the
    InferenceService's own Service selects them."""
    assert spec.inference_pool is not None
    name = owner["metadata"]["name"]
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": POOL_KIND,
        "metadata": _metadata(owner, pool_name(name), render.labels(name)),
        "spec": {
            "selector": {"matchLabels": dict(pod_selector)},
            "targetPorts": [{"number": render.SERVER_PORT}],
            "endpointPickerRef": {
                "name": picker_name(name),
                "port": {"number": GRPC_PORT},
                "failureMode": spec.inference_pool.picker.failure_mode,
            },
        },
    }


def render_picker_rbac(owner: dict[str, Any]) -> list[dict[str, Any]]:
    """A ServiceAccount whose Role reads what the picker watches: its pool and the pods the pool selects."""
    name = owner["metadata"]["name"]
    account, labels = picker_name(name), picker_labels(name)
    read = ["get", "list", "watch"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, account, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(owner, account, labels),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": read},
                {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": read},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(owner, account, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": owner["metadata"]["namespace"]}],
        },
    ]


def _grpc_probe(service: str, period: int, failures: int) -> dict[str, Any]:
    """The picker's grpc.health.v1 services, as GIE's picker names them: `liveness` serves from the start, `readiness`
    once the pool has been read (and no longer while it drains)."""
    return {
        "grpc": {"port": HEALTH_PORT, "service": service},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def render_picker_deployment(owner: dict[str, Any], spec: api.InferenceServiceSpec) -> dict[str, Any]:
    assert spec.inference_pool is not None
    picker = spec.inference_pool.picker
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    container: dict[str, Any] = {
        "name": PICKER_CONTAINER,
        "image": picker.image or spec.image,
        "command": ["capstan", "picker"],
        "args": picker_args(pool_name(name), namespace, picker.failure_mode),
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": picker.resources if picker.resources is not None else PICKER_RESOURCES,
        "readinessProbe": _grpc_probe("readiness", 5, 2),
        "livenessProbe": _grpc_probe("liveness", 10, 6),
        "securityContext": pod_security.container_security_context(),
        "volumeMounts": [pod_security.scratch_mount()],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    labels = picker_labels(name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, picker_name(name), labels),
        "spec": {
            "replicas": picker.replicas,
            "selector": {"matchLabels": picker_selector(name)},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": picker_name(name),
                    "containers": [container],
                    "securityContext": pod_security.pod_security_context(),
                    "volumes": [pod_security.scratch_volume()],
                    "enableServiceLinks": False,
                },
            },
        },
    }


def render_picker_service(owner: dict[str, Any]) -> dict[str, Any]:
    """What the InferencePool's endpointPickerRef names: ext_proc over HTTP/2 cleartext, and the picker's metrics."""
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, picker_name(name), picker_labels(name)),
        "spec": {
            "type": "ClusterIP",
            "selector": picker_selector(name),
            "ports": [
                {
                    "name": "grpc-ext-proc",
                    "port": GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                },
                {"name": "http-metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def render_picker(owner: dict[str, Any], spec: api.InferenceServiceSpec) -> list[dict[str, Any]]:
    """The picker's objects in the order they should be applied: its identity and rights before its pods."""
    return [*render_picker_rbac(owner), render_picker_service(owner), render_picker_deployment(owner, spec)]


def render_all(
    owner: dict[str, Any], spec: api.InferenceServiceSpec, serving: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The pool first (where the cluster lacks its CRD, applying it fails before the picker exists), then the picker.
    `serving`: the objects render.render_all or render_group.render_all_groups returned, whose Service NAME selects
    the pods that take requests."""
    name = owner["metadata"]["name"]
    service = next(o for o in serving if o["kind"] == "Service" and o["metadata"]["name"] == name)
    return [render_inference_pool(owner, spec, service["spec"]["selector"]), *render_picker(owner, spec)]


def rendered_objects(name: str) -> list[tuple[str, str]]:
    """(kind, name) of everything spec.inferencePool renders, in the order to delete them when it is turned off."""
    picker = picker_name(name)
    kinds = ["Deployment", "Service", "RoleBinding", "Role", "ServiceAccount"]
    return [(POOL_KIND, pool_name(name))] + [(kind, picker) for kind in kinds]
