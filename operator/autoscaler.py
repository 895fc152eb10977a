"""The autoscaling policy: the pods' load -> desired replicas, smoothed so that replicas do not flap.

A pure function of its inputs, in the manner of the HorizontalPodAutoscaler: each evaluation gives a
raw recommendation (total load / target per replica); scaling up takes the lowest recommendation of the
scale-up window (0 s by default: at once), scaling down the highest of the scale-down window (300 s by
default: only after load has stayed low that long). The recommendation history lives in the resource's
status, so a restarted operator continues where the last one stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capstan.operator.api import DEMAND_REFRESH_SECONDS, AutoscalingSpec, ScaleRecommendation

TOLERANCE = 0.1  # within 10% of the target, do nothing: noise is not load
MAX_SCALE_UP_FACTOR = 2  # at most double per decision (or +4, whichever is more), as the HPA does
MAX_SCALE_UP_STEP = 4


@dataclass(frozen=True)
class PodLoad:
    """One pod's gauges, read from its /metrics."""

    running: float
    waiting: float
    kv_cache_usage: float

    def value(self, metric: str) -> float:
        return self.running + self.waiting if metric == "concurrentRequests" else self.kv_cache_usage


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    recommendations: list[ScaleRecommendation]
    reason: str

    def changes(self, current: int) -> bool:
        return self.replicas != current


def recommend(policy: AutoscalingSpec, current: int, loads: list[PodLoad]) -> tuple[int, str]:
    """The unsmoothed replica count for this one sample of load, and why."""
    if not loads:
        return current, "no pod reported metrics; keeping the current replica count"
    total = sum(load.value(policy.metric) for load in loads)
    per_replica = total / len(loads)
    described = f"{policy.metric} {per_replica:.2f} per replica (target {policy.target:g})"
    if current > 0 and abs(per_replica / policy.target - 1) <= TOLERANCE and len(loads) == current:
        return current, f"{described} is within tolerance"
    return math.ceil(total / policy.target - 1e-9), described


def demand_floor(policy: AutoscalingSpec, low: int, last_request: float | None, now: float) -> int:
    """minReplicas 0 counts as 1 while the gateway saw a request within the idle period (the scale-down window, and
    at least three of the gateway's refreshes): scale from zero on demand, back to zero once idle."""
    if low > 0 or last_request is None:
        return low
    idle = max(policy.scale_down_stabilization_seconds, 3 * DEMAND_REFRESH_SECONDS)
    return 1 if now - last_request < idle else 0


def decide(
    policy: AutoscalingSpec,
    bounds: tuple[int, int],
    current: int,
    loads: list[PodLoad],
    history: list[ScaleRecommendation],
    now: float,
    floor: int = 0,
) -> ScaleDecision:
    """Desired replicas given this sample and the recommendations of the stabilisation windows."""
    low, high = bounds
    raw, described = recommend(policy, current, loads)
    raw = min(max(raw, low), high)
    horizon = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)
    kept = [r for r in history if now - r.time < horizon] + [ScaleRecommendation(time=now, replicas=raw)]

    def window(seconds: int) -> list[int]:
        return [r.replicas for r in kept if now - r.time <= seconds]

    up_to = min(window(policy.scale_up_stabilization_seconds))
    down_to = max(window(policy.scale_down_stabilization_seconds))
    desired = current
    if up_to > current:
        desired = min(up_to, max(current * MAX_SCALE_UP_FACTOR, current + MAX_SCALE_UP_STEP))
        reason = f"scale up {current} -> {desired}: {described}"
    elif down_to < current:
        desired = down_to
        reason = f"scale down {current} -> {desired}: {described}, low for {policy.scale_down_stabilization_seconds}s"
    else:
        reason = f"keep {current}: {described}"
    desired = min(max(desired, low), high)  # bounds also apply when they change under a running service
    if desired < floor:  # recent requests through the gateway (demand_floor)
        reason = (
            f"{'scale up' if current < floor else 'keep'} {current} -> {floor}: requests arrived through the "
            f"gateway within the idle period (scale from zero); {described}"
        )
        desired = floor
    return ScaleDecision(desired, kept, reason)
