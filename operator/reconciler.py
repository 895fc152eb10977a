"""One reconciliation of one InferenceService: render, apply, observe, report. Level-triggered: it looks
only at the resource and the cluster as they are now, so running it again (or after a restart of the
operator) converges to the same objects."""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic
from kubernetes.client.exceptions import ApiException

from capstan.operator import adapters, api, autoscaler, host_groups, pool_status, render, render_group, render_pool
from capstan.operator.cluster_client import ClusterClient
from capstan.operator.pod_metrics import PodAddresses, fetch_loads
from capstan.operator.pod_models import fetch_pod_adapters
from capstan.operator.status import compute_status

log = logging.getLogger(__name__)

# (body, type "Normal"/"Warning", reason, message): how a reconciliation reports what it did.
EventSink = Callable[[dict[str, Any], str, str, str], None]


@dataclass
class OperatorConfig:
    default_image: str = "localhost/capstan:0.1.0"  # `make image` builds it; no registry carries it
    resync_seconds: float = 10.0
    pod_addresses: PodAddresses = field(default_factory=PodAddresses)
    gateway_url: str | None = None  # the gateway's OpenAI base URL, reported as every service's status.url


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _last_request(meta: dict[str, Any]) -> float | None:
    try:
        return float((meta.get("annotations") or {})[api.DEMAND_ANNOTATION])
    except (KeyError, ValueError):
        return None


def _current_replicas(spec: api.InferenceServiceSpec, status: dict[str, Any]) -> int:
    """What the Deployment should run before this round's autoscaling decision."""
    if spec.autoscaling is None:
        return spec.replicas
    low, high = spec.bounds()
    decided = (status.get("autoscaling") or {}).get("desiredReplicas")
    return min(max(decided if decided is not None else spec.replicas, low), high)


class Reconciler:
    def __init__(self, client: ClusterClient, config: OperatorConfig, emit: EventSink):
        self.client, self.config, self.emit = client, config, emit

    def reconcile(self, body: dict[str, Any], *, autoscale: bool) -> None:
        meta, status = body["metadata"], body.get("status") or {}
        name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 1)
        try:
            spec = api.InferenceServiceSpec.model_validate(body.get("spec") or {})
        except pydantic.ValidationError as error:  # the CRD refuses most of this; report the rest
            self._report_invalid(body, generation, "InvalidSpec", str(error))
            return
        if spec.image is None:
            spec = spec.model_copy(update={"image": self.config.default_image})

        replicas = _current_replicas(spec, status)
        floor = 0
        if spec.autoscaling is not None:
            floor = autoscaler.demand_floor(spec.autoscaling, spec.bounds()[0], _last_request(meta), time.time())
            autoscale = autoscale or replicas < floor  # a request waits at the gateway: scale from zero now
        pods = self.client.list("Pod", namespace, render.selector_string(name))
        autoscaling_status = None
        if autoscale and spec.autoscaling is not None:
            replicas, autoscaling_status = self._autoscale(body, spec, status, replicas, pods, floor)

        multi_host = render_group.is_multi_host(spec)
        leader_worker_set = multi_host and self.client.serves(render_group.LWS_API_VERSION)
        desired = (
            render_group.render_all_groups(body, spec, replicas, leader_worker_set)
            if multi_host
            else render.render_all(body, spec, replicas)
        )
        try:
            applied = [self.client.apply(obj) for obj in desired]
        except ApiException as error:
            if error.status not in (400, 422):
                raise
            # The API server refused what the spec rendered to (e.g. a podTemplate override): the user must act.
            self._report_invalid(body, generation, "InvalidPodTemplate", _api_message(error))
            return
        if status.get("observedGeneration") != generation:
            kinds = ", ".join(dict.fromkeys(obj["kind"] for obj in applied))
            self.emit(body, "Normal", "Applied", f"generation {generation}: applied {kinds} ({replicas} replicas)")
        pool = self._apply_inference_pool(body, spec, desired) if spec.inference_pool_enabled() else None
        if pool is None:
            self._prune_inference_pool(body)
        self._prune_model_cache_claim(body, spec)
        self._prune_adapters_configmap(body, spec)
        self._prune_workloads(body, applied, leader_worker_set)
        workload = self._observe_workload(body, applied, pods)
        new_status = compute_status(
            name=name,
            namespace=namespace,
            generation=generation,
            spec=spec,
            desired=replicas,
            deployment=workload,
            pods=pods,
            previous_conditions=status.get("conditions", []),
            now=_now(),
            url=self.config.gateway_url,
            reported_adapters=self._reported_adapters(pods) if spec.lora_enabled() else None,
            pool=pool,
        )
        if autoscaling_status is not None:
            new_status["autoscaling"] = autoscaling_status
        elif spec.autoscaling is None and status.get("autoscaling"):
            new_status["autoscaling"] = None  # merge patch: remove what no longer applies
        self._report_transitions(body, status.get("conditions", []), new_status["conditions"])
        if any(status.get(k) != v for k, v in new_status.items()):
            self.client.patch_status(namespace, name, new_status)

    def _autoscale(
        self,
        body: dict[str, Any],
        spec: api.InferenceServiceSpec,
        status: dict[str, Any],
        current: int,
        pods: list[dict[str, Any]],
        floor: int,
    ) -> tuple[int, dict[str, Any]]:
        assert spec.autoscaling is not None
        meta = body["metadata"]
        serving = [p for p in pods if _is_ready(p) and render_group.is_leader(p)]  # workers take no requests
        loads = fetch_loads(self.config.pod_addresses.resolve(serving))
        previous = api.AutoscalingStatus.model_validate(status.get("autoscaling") or {})
        decision = autoscaler.decide(
            spec.autoscaling, spec.bounds(), current, loads, previous.recommendations, time.time(), floor
        )
        last_scale_time = previous.last_scale_time
        if decision.changes(current):
            last_scale_time = _now()
            self.emit(body, "Normal", "Scaled", decision.reason)
            log.info("%s/%s: %s", meta["namespace"], meta["name"], decision.reason)
        result = api.AutoscalingStatus(
            desired_replicas=decision.replicas,
            last_scale_time=last_scale_time,
            last_decision=decision.reason if decision.changes(current) else previous.last_decision or decision.reason,
            recommendations=decision.recommendations,
        )
        return decision.replicas, result.model_dump(by_alias=True, exclude_none=True)

    def _apply_inference_pool(
        self, body: dict[str, Any], spec: api.InferenceServiceSpec, desired: list[dict[str, Any]]
    ) -> pool_status.PoolReport:
        """The InferencePool, then its picker; without the GIE CRD in the cluster, neither (the status says so)."""
        name = body["metadata"]["name"]
        try:
            applied = [self.client.apply(obj) for obj in render_pool.render_all(body, spec, desired)]
        except ApiException as error:
            if error.status == 404:  # the first, the InferencePool: the API server serves no such resource
                return pool_status.pool_report(name, spec, crd_served=False, picker=None)
            if error.status not in (400, 403, 422):
                raise
            # Refused: the picker's fields (e.g. its resources), or the operator's RBAC from an older chart.
            reason = "Forbidden" if error.status == 403 else "InvalidPicker"
            return pool_status.refused(name, spec, reason, _api_message(error))
        return pool_status.pool_report(name, spec, crd_served=True, picker=applied[-1])

    def _prune_inference_pool(self, body: dict[str, Any]) -> None:
        """Delete the pool and its picker once spec.inferencePool is gone or off. The pool is applied first and the
        picker's Deployment last, so when neither is there, nothing of it is."""
        meta = body["metadata"]
        objects = render_pool.rendered_objects(meta["name"])
        probes = [self.client.get(kind, meta["namespace"], name) for kind, name in objects[:2]]
        if not any(_owned_by(obj, meta) for obj in probes):
            return
        for kind, name in objects:
            obj = self.client.get(kind, meta["namespace"], name)
            if _owned_by(obj, meta):
                self.client.delete(kind, meta["namespace"], name)
        self.emit(body, "Normal", "Deleted", f"InferencePool {objects[0][1]} and its picker are no longer requested")

    def _reported_adapters(self, pods: list[dict[str, Any]]) -> dict[str, list[str] | None]:
        """Each ready serving pod (leaders only: workers take no requests) -> the adapters it lists."""
        serving = [p for p in pods if _is_ready(p) and render_group.is_leader(p)]
        return fetch_pod_adapters(self.config.pod_addresses.by_pod(serving))

    def _observe_workload(
        self, body: dict[str, Any], applied: list[dict[str, Any]], pods: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The Deployment, or the multi-host groups summarized as one; rolls the next outdated group."""
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for obj in applied:
            by_kind.setdefault(obj["kind"], []).append(obj)
        if "Deployment" in by_kind:
            return by_kind["Deployment"][0]
        if "LeaderWorkerSet" in by_kind:
            return host_groups.summarize_leader_worker_set(by_kind["LeaderWorkerSet"][0])
        statefulsets = by_kind["StatefulSet"]
        group = host_groups.group_to_replace(statefulsets, pods)
        if group is not None:
            for pod in group.pods:
                self.client.delete("Pod", body["metadata"]["namespace"], pod)
            self.emit(
                body,
                "Normal",
                "RollingGroup",
                f"replacing all {len(group.pods)} pods of group {group.name} with the current spec",
            )
        return host_groups.summarize(statefulsets, pods)

    def _prune_workloads(self, body: dict[str, Any], applied: list[dict[str, Any]], leader_worker_set: bool) -> None:
        """Delete owned workloads the spec no longer renders: groups beyond the replica count, and the other
        shape's objects when spec.parallelism.hosts crosses 1."""
        meta = body["metadata"]
        keep = {(obj["kind"], obj["metadata"]["name"]) for obj in applied}
        kinds = ["Deployment", "StatefulSet", "Service"] + (["LeaderWorkerSet"] if leader_worker_set else [])
        for kind in kinds:
            for obj in self.client.list(kind, meta["namespace"], render.selector_string(meta["name"])):
                owners = obj["metadata"].get("ownerReferences", [])
                if (kind, obj["metadata"]["name"]) not in keep and any(o.get("uid") == meta["uid"] for o in owners):
                    self.client.delete(kind, meta["namespace"], obj["metadata"]["name"])
                    self.emit(body, "Normal", "Deleted", f"{kind} {obj['metadata']['name']} is no longer rendered")

    def _prune_model_cache_claim(self, body: dict[str, Any], spec: api.InferenceServiceSpec) -> None:
        """Delete the cache PVC the operator created once the spec no longer asks for one."""
        if spec.model_cache is not None and spec.model_cache.size is not None:
            return
        meta = body["metadata"]
        claim = self.client.get("PersistentVolumeClaim", meta["namespace"], f"{meta['name']}-model-cache")
        if claim is None:
            return
        owners = claim.get("metadata", {}).get("ownerReferences", [])
        if any(o.get("uid") == meta["uid"] for o in owners):
            self.client.delete("PersistentVolumeClaim", meta["namespace"], claim["metadata"]["name"])
            self.emit(
                body, "Normal", "Deleted", f"model cache claim {claim['metadata']['name']} is no longer requested"
            )

    def _prune_adapters_configmap(self, body: dict[str, Any], spec: api.InferenceServiceSpec) -> None:
        """Delete the adapters' ConfigMap once the spec turns LoRA off (the pods no longer mount it)."""
        if spec.lora_enabled():
            return
        meta = body["metadata"]
        configmap = self.client.get("ConfigMap", meta["namespace"], adapters.configmap_name(meta["name"]))
        if configmap is None:
            return
        owners = configmap.get("metadata", {}).get("ownerReferences", [])
        if any(o.get("uid") == meta["uid"] for o in owners):
            self.client.delete("ConfigMap", meta["namespace"], configmap["metadata"]["name"])

    def _report_transitions(
        self, body: dict[str, Any], before: list[dict[str, Any]], after: list[dict[str, Any]]
    ) -> None:
        old = {c["type"]: c for c in before}
        for condition in after:
            previous = old.get(condition["type"], {})
            if (previous.get("status"), previous.get("reason")) == (condition["status"], condition["reason"]):
                continue
            if condition["type"] == "Degraded" and condition["status"] == "True":
                self.emit(body, "Warning", condition["reason"], condition["message"])
            elif condition["type"] == "Ready" and condition["reason"] in ("Serving", "Starting", "ScaledToZero"):
                self.emit(body, "Normal", condition["reason"], condition["message"])  # problems: Degraded's event
            elif condition["type"] == pool_status.CONDITION and condition["reason"] != "PickerStarting":
                kind = "Normal" if condition["status"] == "True" else "Warning"
                self.emit(body, kind, condition["reason"], condition["message"])

    def _report_invalid(self, body: dict[str, Any], generation: int, reason: str, message: str) -> None:
        meta, status = body["metadata"], body.get("status") or {}
        degraded: dict[str, Any] = next((c for c in status.get("conditions", []) if c["type"] == "Degraded"), {})
        if (degraded.get("reason"), degraded.get("message"), status.get("observedGeneration")) == (
            reason,
            message,
            generation,
        ):
            return  # already reported
        conditions = [c for c in status.get("conditions", []) if c["type"] != "Degraded"]
        conditions.append(
            {
                "type": "Degraded",
                "status": "True",
                "reason": reason,
                "message": message,
                "lastTransitionTime": _now(),
                "observedGeneration": generation,
            }
        )
        self.emit(body, "Warning", reason, message)
        self.client.patch_status(
            meta["namespace"], meta["name"], {"observedGeneration": generation, "conditions": conditions}
        )


def _owned_by(obj: dict[str, Any] | None, owner_meta: dict[str, Any]) -> bool:
    return obj is not None and any(
        o.get("uid") == owner_meta["uid"] for o in obj["metadata"].get("ownerReferences", [])
    )


def _is_ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def _api_message(error: ApiException) -> str:
    try:
        return json.loads(error.body or "")["message"]
    except (TypeError, ValueError, KeyError):
        return f"{error.status} {error.reason}"
