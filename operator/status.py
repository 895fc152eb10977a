"""Pure functions: what the owned Deployment and its pods say -> the InferenceService's status.

Conditions follow the Kubernetes API conventions: Ready (the endpoint serves), Progressing (a rollout
or scaling is under way), Degraded (something needs the user: an image that cannot be pulled, a crash
loop, no node with the requested accelerator), each with a CamelCase reason and a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capstan.operator import api
from capstan.operator.accelerators import ACCELERATORS
from capstan.operator.adapter_status import adapter_report
from capstan.operator.pool_status import CONDITION as POOL_CONDITION
from capstan.operator.pool_status import PoolReport
from capstan.operator.render import selector_string, service_url

IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_REASONS = {"CreateContainerConfigError", "CreateContainerError"}
MESSAGE_TAIL = 512  # of a crashed container's termination message, quoted in the Degraded condition


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


def _container_statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
    status = pod.get("status", {})
    return status.get("initContainerStatuses", []) + status.get("containerStatuses", [])


def diagnose(pods: list[dict[str, Any]], spec: api.InferenceServiceSpec) -> Problem | None:
    """The most actionable problem among the pods, or None."""
    found: dict[str, Problem] = {}
    for pod in pods:
        name = pod["metadata"]["name"]
        for container in _container_statuses(pod):
            waiting = container.get("state", {}).get("waiting") or {}
            reason, detail = waiting.get("reason"), waiting.get("message", "")
            if reason in IMAGE_PULL_REASONS:
                found.setdefault(
                    "ImagePullFailed",
                    Problem(
                        "ImagePullFailed",
                        f"pod {name} cannot pull image {container.get('image')}: {reason} {detail}".strip(),
                    ),
                )
            elif reason == "CrashLoopBackOff":
                terminated = container.get("lastState", {}).get("terminated") or {}
                # The runtime's own words, e.g. a --tensor-parallel-size that does not divide the heads.
                said = (terminated.get("message") or "").strip()[-MESSAGE_TAIL:]
                found.setdefault(
                    "CrashLoop",
                    Problem(
                        "CrashLoop",
                        f"container {container['name']} of pod {name} keeps crashing "
                        f"(last exit code {terminated.get('exitCode')}, {container.get('restartCount', 0)}"
                        f" restarts)" + (f": {said}" if said else ""),
                    ),
                )
            elif reason in CONFIG_REASONS:
                found.setdefault("InvalidPodConfiguration", Problem("InvalidPodConfiguration", f"pod {name}: {detail}"))
        for condition in pod.get("status", {}).get("conditions", []):
            if (
                condition["type"] == "PodScheduled"
                and condition["status"] == "False"
                and condition.get("reason") == "Unschedulable"
            ):
                found.setdefault("Unschedulable", _unschedulable(name, condition.get("message", ""), spec))
    for reason in ("ImagePullFailed", "CrashLoop", "InvalidPodConfiguration", "Unschedulable"):
        if reason in found:
            return found[reason]
    return None


def _unschedulable(pod: str, message: str, spec: api.InferenceServiceSpec) -> Problem:
    accelerator = ACCELERATORS[spec.accelerator.type]
    selector_miss = "node affinity/selector" in message or "didn't match Pod's node affinity" in message
    short_of_devices = accelerator.resource is not None and f"Insufficient {accelerator.resource}" in message
    if accelerator.resource and (selector_miss or short_of_devices):
        wanted = ", ".join(f"{k}={v}" for k, v in accelerator.node_labels.items())
        return Problem(
            "AcceleratorUnavailable",
            f"no node offers {spec.accelerator.count} x {spec.accelerator.type} ({accelerator.resource}, "
            f"node label {wanted}) for pod {pod}: {message}",
        )
    return Problem("Unschedulable", f"pod {pod} cannot be scheduled: {message}")


def _condition(
    type_: str,
    ok: bool | None,
    reason: str,
    message: str,
    generation: int,
    previous: dict[str, dict[str, Any]],
    now: str,
) -> dict[str, Any]:
    status = "Unknown" if ok is None else "True" if ok else "False"
    before = previous.get(type_)
    changed = before is None or before.get("status") != status
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if before is None or changed else before.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def compute_status(
    *,
    name: str,
    namespace: str,
    generation: int,
    spec: api.InferenceServiceSpec,
    desired: int,
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    previous_conditions: list[dict[str, Any]],
    now: str,
    url: str | None = None,
    reported_adapters: dict[str, list[str] | None] | None = None,
    pool: PoolReport | None = None,
) -> dict[str, Any]:
    """The status subresource body (camelCase), without the autoscaling part. `url`: the gateway's, when one routes.
    `reported_adapters`: with LoRA on, each ready serving pod -> the adapters its /v1/models lists (None: no answer).
    `pool`: with spec.inferencePool on, what the cluster holds of it."""
    observed = (deployment or {}).get("status", {})
    replicas, ready = observed.get("replicas", 0), observed.get("readyReplicas", 0)
    updated, available = observed.get("updatedReplicas", 0), observed.get("availableReplicas", 0)
    deployment_current = deployment is not None and observed.get("observedGeneration", 0) >= deployment["metadata"].get(
        "generation", 0
    )
    previous = {c["type"]: c for c in previous_conditions}
    url = url or service_url(name, namespace)

    problem = diagnose(pods, spec)
    for condition in observed.get("conditions", []):
        if condition.get("reason") == "ProgressDeadlineExceeded" and problem is None:
            problem = Problem("ProgressDeadlineExceeded", condition.get("message", ""))
        # The API server refused the pods themselves, e.g. a namespace's Pod Security level: its words, verbatim.
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            problem = Problem("PodsRejected", condition.get("message", ""))

    rolled_out = deployment_current and updated == desired and replicas == desired and available >= desired
    progress = f"{updated} of {desired} replicas updated, {ready} ready"
    if ready > 0:
        readiness = (True, "Serving", f"{ready} of {desired} replicas ready; OpenAI endpoint at {url}")
    elif desired == 0:
        readiness = (False, "ScaledToZero", "no replicas are requested")
    elif problem:
        readiness = (False, problem.reason, problem.message)
    else:
        readiness = (False, "Starting", "waiting for replicas to load the model and compile (startup probe on /ready)")

    conditions = [
        _condition("Ready", *readiness, generation, previous, now),
        _condition(
            "Progressing",
            not rolled_out,
            "RollingOut" if not rolled_out else "Complete",
            progress if not rolled_out else f"all {desired} replicas run the current spec",
            generation,
            previous,
            now,
        ),
        _condition(
            "Degraded",
            problem is not None,
            problem.reason if problem else "AsExpected",
            problem.message if problem else "",
            generation,
            previous,
            now,
        ),
    ]
    adapter_fields: dict[str, Any] = {"adapters": None, "replicaAdapters": None}  # merge patch: None removes
    if spec.lora_enabled():
        report = adapter_report(spec, reported_adapters or {})
        adapter_fields = report.fields
        conditions.append(
            _condition("AdaptersLoaded", report.loaded, report.reason, report.message, generation, previous, now)
        )
    pool_fields: dict[str, Any] = {"inferencePool": None}
    if pool is not None:
        pool_fields = pool.fields
        conditions.append(_condition(POOL_CONDITION, pool.ready, pool.reason, pool.message, generation, previous, now))
    return {
        **adapter_fields,
        **pool_fields,
        "observedGeneration": generation,
        "conditions": conditions,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "desiredReplicas": desired,
        "selector": selector_string(name),
        "url": url,
    }
