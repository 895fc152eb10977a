"""Pure: what the cluster holds of spec.inferencePool -> status.inferencePool and the InferencePoolReady condition's
(status, reason, message)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capstan.operator import api, render, render_pool

CONDITION = "InferencePoolReady"
CRD_MISSING = "InferencePoolCRDMissing"
CRD_FILE = "crds/gateway-api-inference-extension/inference.networking.k8s.io_inferencepools.yaml"


@dataclass(frozen=True)
class PoolReport:
    fields: dict[str, Any]  # inferencePool (camelCase, as the status carries it)
    ready: bool | None  # the condition: True, False, or None (Unknown)
    reason: str
    message: str


def pool_report(
    name: str, spec: api.InferenceServiceSpec, crd_served: bool, picker: dict[str, Any] | None
) -> PoolReport:
    """`crd_served`: the API server took the InferencePool; `picker`: the picker's Deployment as applied (None when
    the pool could not be)."""
    assert spec.inference_pool is not None
    pool, picker_name = render_pool.pool_name(name), render_pool.picker_name(name)
    wanted = spec.inference_pool.picker.replicas
    observed = (picker or {}).get("status", {})
    ready = observed.get("readyReplicas", 0)
    fields = {
        "inferencePool": {
            "name": pool,
            "picker": {"name": picker_name, "replicas": observed.get("replicas", 0), "readyReplicas": ready},
        }
    }
    if not crd_served:
        return PoolReport(
            fields,
            False,
            CRD_MISSING,
            f"the cluster does not serve {render_pool.POOL_API_VERSION} InferencePools, so InferencePool {pool} and"
            " its endpoint picker are not created (the serving pods run without them): install the Gateway API"
            " Inference Extension's CRD (helm upgrade ... --set inferencePool.installCRD=true, or kubectl apply"
            f" --server-side -f {CRD_FILE}); the operator creates them at its next resync",
        )
    for condition in observed.get("conditions", []):
        # The API server refused the picker's pods, e.g. a namespace's Pod Security level: its words, verbatim.
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            return PoolReport(fields, False, "PickerPodsRejected", f"picker {picker_name}: {condition.get('message')}")
    progress = f"{ready} of {wanted} replicas of endpoint picker {picker_name} ready"
    if ready > 0:
        return PoolReport(
            fields,
            True,
            "PickerReady",
            f"InferencePool {pool} selects the serving pods on port {render.SERVER_PORT}; {progress}"
            f" ({spec.inference_pool.picker.failure_mode}). Route to it with an HTTPRoute backendRef"
            f" {{group: {render_pool.POOL_GROUP}, kind: InferencePool, name: {pool}}}",
        )
    return PoolReport(fields, False, "PickerStarting", f"{progress} (gRPC health on port {render_pool.HEALTH_PORT})")


def refused(name: str, spec: api.InferenceServiceSpec, reason: str, message: str) -> PoolReport:
    """The API server refused the pool's or the picker's objects, in its own words: someone must act."""
    return PoolReport(pool_report(name, spec, True, None).fields, False, reason, message)
