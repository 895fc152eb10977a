"""Pure functions over the StatefulSets of multi-host replicas and their pods: which groups are ready (all
their hosts are), which run the current spec, and which group to replace next in a rollout.

A group runs one `jax.distributed` program, so a partial update would mix two programs: its StatefulSet
updates `OnDelete`, and the operator deletes all of an outdated group's pods together, one group at a
time, only while every other group is ready (the rollout's budget is one unavailable group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capstan.operator.render_group import REPLICA_LABEL

REVISION_LABEL = "controller-revision-hash"  # the StatefulSet controller's: the revision a pod was made from


@dataclass(frozen=True)
class Group:
    name: str  # the StatefulSet's
    ready: bool  # every host exists, runs and is Ready
    updated: bool  # every host runs the StatefulSet's current revision
    pods: tuple[str, ...]  # names of its pods that are not already terminating


def _is_ready(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", [])
    )


def observe(statefulset: dict[str, Any], pods: list[dict[str, Any]]) -> Group:
    replica = statefulset["metadata"]["labels"][REPLICA_LABEL]
    hosts = statefulset["spec"]["replicas"]
    mine = [p for p in pods if p["metadata"].get("labels", {}).get(REPLICA_LABEL) == replica]
    status = statefulset.get("status", {})
    current = status.get("observedGeneration", 0) >= statefulset["metadata"].get("generation", 0)
    revision = status.get("updateRevision")
    live = [p for p in mine if not p["metadata"].get("deletionTimestamp")]
    return Group(
        name=statefulset["metadata"]["name"],
        ready=len(live) == hosts and all(_is_ready(p) for p in live),
        updated=current
        and revision is not None
        and len(live) == hosts
        and all(p["metadata"].get("labels", {}).get(REVISION_LABEL) == revision for p in live),
        pods=tuple(sorted(p["metadata"]["name"] for p in live)),
    )


def outdated(statefulset: dict[str, Any], pods: list[dict[str, Any]]) -> bool:
    """Some live pod of the group was made from an older revision than the StatefulSet's current one."""
    status = statefulset.get("status", {})
    if status.get("observedGeneration", 0) < statefulset["metadata"].get("generation", 0):
        return False  # the controller has not computed the new revision yet: wait for it
    replica = statefulset["metadata"]["labels"][REPLICA_LABEL]
    return any(
        p["metadata"].get("labels", {}).get(REPLICA_LABEL) == replica
        and not p["metadata"].get("deletionTimestamp")
        and p["metadata"].get("labels", {}).get(REVISION_LABEL) != status.get("updateRevision")
        for p in pods
    )


def group_to_replace(statefulsets: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Group | None:
    """The next outdated group whose pods should all be deleted now, or None (up to date, or waiting)."""
    groups = {s["metadata"]["name"]: observe(s, pods) for s in statefulsets}
    candidates = [groups[s["metadata"]["name"]] for s in statefulsets if outdated(s, pods)]
    candidates.sort(key=lambda g: g.ready)  # an unready outdated group costs nothing to replace: first
    for group in candidates:
        if all(other.ready for other in groups.values() if other.name != group.name):
            return group
    return None


def summarize(statefulsets: list[dict[str, Any]], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The groups counted as replicas, in the shape of a Deployment's status, for status.compute_status."""
    groups = [observe(s, pods) for s in statefulsets]
    ready = sum(g.ready for g in groups)
    return {
        "metadata": {"generation": 0},
        "status": {
            "observedGeneration": 0,
            "replicas": len(groups),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": sum(g.updated for g in groups),
        },
    }


def summarize_leader_worker_set(lws: dict[str, Any]) -> dict[str, Any]:
    """A LeaderWorkerSet counts groups itself (a group is ready when all its pods are)."""
    status = lws.get("status", {})
    ready = status.get("readyReplicas", 0)
    return {
        "metadata": {"generation": 0},
        "status": {
            "observedGeneration": 0,
            "replicas": status.get("replicas", 0),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": status.get("updatedReplicas", 0),
        },
    }
