"""Pure functions for replicas of several hosts (spec.parallelism.hosts > 1).

Such a replica is a group of pods, one per host, that `jax.distributed` joins into one program: process 0
is the leader (it serves HTTP and hosts the coordinator), the others are workers. The group renders as a
LeaderWorkerSet when the cluster serves leaderworkerset.x-k8s.io/v1, otherwise as one StatefulSet per
replica (pods NAME-REPLICA-INDEX) governed by one headless Service (NAME-hosts) for stable DNS. Only
leaders are behind the Service NAME. Environment for the runtime: JAX_COORDINATOR_ADDRESS (host:port),
JAX_NUM_PROCESSES and JAX_PROCESS_ID.
"""

from __future__ import annotations

from typing import Any

from capstan.operator import api, render
from capstan.operator.accelerators import GKE_NODE_POOL_LABEL, is_tpu

COORDINATOR_PORT = 8476  # jax.distributed's coordinator, on the leader
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # the StatefulSet controller labels each pod with its ordinal
REPLICA_LABEL = f"{api.GROUP}/replica"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def is_multi_host(spec: api.InferenceServiceSpec) -> bool:
    return spec.parallelism.hosts > 1


def hosts_name(name: str) -> str:
    """The headless Service (StatefulSets) or the LeaderWorkerSet (which makes its own headless Service)."""
    return f"{name}-hosts"


def group_name(name: str, replica: int) -> str:
    return f"{name}-{replica}"


def leader_selector(name: str, leader_worker_set: bool) -> dict[str, str]:
    """The Service's selector: process 0 of every group, the only one that takes requests."""
    return render.selector(name) | ({LWS_WORKER_INDEX_LABEL: "0"} if leader_worker_set else {POD_INDEX_LABEL: "0"})


def is_leader(pod: dict[str, Any]) -> bool:
    """Process 0 of its group, or the pod of a single-host replica."""
    labels = pod["metadata"].get("labels", {})
    if REPLICA_LABEL in labels:
        return labels.get(POD_INDEX_LABEL) == "0"
    return labels.get(LWS_WORKER_INDEX_LABEL, "0") == "0"


def _dns(pod: str, name: str, namespace: str) -> str:
    return f"{pod}.{hosts_name(name)}.{namespace}.svc.cluster.local"


def _label_env(var: str, label: str) -> dict[str, Any]:
    return {"name": var, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}


def _group_pod_template(
    name: str, spec: api.InferenceServiceSpec, distributed_env: list[dict[str, Any]], group_labels: dict[str, str]
) -> dict[str, Any]:
    template = render.render_pod_template(name, spec)
    template["metadata"]["labels"].update(group_labels)
    pod = template["spec"]
    container = next(c for c in pod["containers"] if c["name"] == render.CONTAINER_NAME)
    container["env"] = [*distributed_env, *container.get("env", [])]
    # A host that exits (e.g. the runtime refusing a shape) leaves its last words in status for the operator.
    container.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    container["ports"] = [
        *container.get("ports", []),
        {"name": "coordinator", "containerPort": COORDINATOR_PORT, "protocol": "TCP"},
    ]
    if "affinity" not in pod and group_labels:
        pod["affinity"] = _group_affinity(name, spec, group_labels)
    return template


def _group_affinity(name: str, spec: api.InferenceServiceSpec, group_labels: dict[str, str]) -> dict[str, Any]:
    """One host per node; the hosts of a TPU group in one node pool, which is one slice on GKE."""
    group = {"labelSelector": {"matchLabels": render.selector(name) | group_labels}}
    affinity: dict[str, Any] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [group | {"topologyKey": "kubernetes.io/hostname"}]
        }
    }
    if is_tpu(spec.accelerator.type):
        affinity["podAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [group | {"topologyKey": GKE_NODE_POOL_LABEL}]
        }
    return affinity


def render_group_statefulset(owner: dict[str, Any], spec: api.InferenceServiceSpec, replica: int) -> dict[str, Any]:
    """Replica `replica` as a StatefulSet of parallelism.hosts pods, started together and replaced together."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    group = group_name(name, replica)
    group_labels = {REPLICA_LABEL: str(replica)}
    env = [
        {"name": "JAX_COORDINATOR_ADDRESS", "value": f"{_dns(f'{group}-0', name, namespace)}:{COORDINATOR_PORT}"},
        {"name": "JAX_NUM_PROCESSES", "value": str(spec.parallelism.hosts)},
        _label_env("JAX_PROCESS_ID", POD_INDEX_LABEL),
    ]
    metadata = render._metadata(name, namespace, owner, group)
    metadata["labels"] |= group_labels
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata,
        "spec": {
            "replicas": spec.parallelism.hosts,
            "serviceName": hosts_name(name),
            "podManagementPolicy": "Parallel",  # jax.distributed waits for every process: start them together
            # A group runs one program: the operator replaces all its pods at once, one group at a time.
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": render.selector(name) | group_labels},
            "revisionHistoryLimit": 3,
            "template": _group_pod_template(name, spec, env, group_labels),
        },
    }


def render_hosts_service(owner: dict[str, Any]) -> dict[str, Any]:
    """Headless: DNS names for every host, published before they are ready (the coordinator must resolve
    while the group is still starting)."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": render._metadata(name, namespace, owner, hosts_name(name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": render.selector(name),
            "ports": [
                {"name": "coordinator", "port": COORDINATOR_PORT, "targetPort": "coordinator", "protocol": "TCP"},
                {"name": "http", "port": render.SERVER_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def render_leader_worker_set(owner: dict[str, Any], spec: api.InferenceServiceSpec, replicas: int) -> dict[str, Any]:
    """All replicas as one LeaderWorkerSet NAME-hosts: groups of parallelism.hosts pods, leader NAME-hosts-G,
    workers NAME-hosts-G-I, behind LWS's own headless Service NAME-hosts."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    lws = hosts_name(name)
    env = [
        _label_env("CAPSTAN_GROUP_INDEX", LWS_GROUP_INDEX_LABEL),
        {
            "name": "JAX_COORDINATOR_ADDRESS",
            "value": f"{_dns(f'{lws}-$(CAPSTAN_GROUP_INDEX)', name, namespace)}:{COORDINATOR_PORT}",
        },
        {"name": "JAX_NUM_PROCESSES", "value": str(spec.parallelism.hosts)},
        _label_env("JAX_PROCESS_ID", LWS_WORKER_INDEX_LABEL),
    ]
    metadata = render._metadata(name, namespace, owner, lws)
    if is_tpu(spec.accelerator.type):  # LWS places each group in one node pool (one slice) itself
        metadata["annotations"] = {"leaderworkerset.sigs.k8s.io/exclusive-topology": GKE_NODE_POOL_LABEL}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": spec.parallelism.hosts,
                "restartPolicy": "RecreateGroupOnPodRestart",  # a lost host breaks the whole program
                "workerTemplate": _group_pod_template(name, spec, env, {}),
            },
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
        },
    }


def render_all_groups(
    owner: dict[str, Any], spec: api.InferenceServiceSpec, replicas: int, leader_worker_set: bool
) -> list[dict[str, Any]]:
    """Every object a multi-host InferenceService owns, in the order they should be applied."""
    name = owner["metadata"]["name"]
    service = render.render_service(owner, pod_selector=leader_selector(name, leader_worker_set))
    if leader_worker_set:
        groups = [render_leader_worker_set(owner, spec, replicas)]
    else:
        groups = [render_hosts_service(owner)] + [render_group_statefulset(owner, spec, r) for r in range(replicas)]
    return [*render.render_volume_sources(owner, spec), service, render.render_pod_disruption_budget(owner), *groups]
