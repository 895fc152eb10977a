"""Pure: what each ready replica's /v1/models reports -> status.adapters, status.replicaAdapters and the
AdaptersLoaded condition's (status, reason, message)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capstan.operator import api

MAX_REPLICAS_LISTED = 64  # status.replicaAdapters: the first pods by name; the counts cover every replica
MAX_NAMED = 5  # adapters, and pods per adapter, named in the condition's message


@dataclass(frozen=True)
class AdapterReport:
    fields: dict[str, Any]  # adapters, replicaAdapters (camelCase, as the status carries them)
    loaded: bool | None  # the condition: True, False, or None (Unknown)
    reason: str
    message: str


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_NAMED])
    return shown + (f" and {len(items) - MAX_NAMED} more" if len(items) > MAX_NAMED else "")


def adapter_report(spec: api.InferenceServiceSpec, reported: dict[str, list[str] | None]) -> AdapterReport:
    """`reported`: every ready serving pod (a multi-host replica's leader) -> the adapters its /v1/models lists,
    or None when it did not answer."""
    answered = {pod: set(names) for pod, names in reported.items() if names is not None}
    silent = sorted(pod for pod, names in reported.items() if names is None)
    fields = {
        "adapters": [
            {"name": a.name, "loadedReplicas": sum(a.name in names for names in answered.values())}
            for a in spec.adapters
        ],
        "replicaAdapters": [
            {"pod": pod, "adapters": sorted(answered[pod])} for pod in sorted(answered)[:MAX_REPLICAS_LISTED]
        ],
    }
    if not reported:
        return AdapterReport(fields, None, "NoReadyReplicas", "no ready replica to ask which adapters it has loaded")
    missing = {
        a.name: sorted(pod for pod, names in answered.items() if a.name not in names)
        for a in spec.adapters
        if any(a.name not in names for names in answered.values())
    }
    if not missing and not silent:
        return AdapterReport(
            fields,
            True,
            "Loaded",
            f"every ready replica ({len(reported)}) has loaded all {len(spec.adapters)} adapters",
        )
    parts = [
        f"{name} not yet on {_names(pods)} ({len(answered) - len(pods)} of {len(reported)} ready replicas have it)"
        for name, pods in list(missing.items())[:MAX_NAMED]
    ]
    if len(missing) > MAX_NAMED:
        parts.append(f"{len(missing) - MAX_NAMED} more adapters not loaded everywhere")
    if silent:
        parts.append(f"no answer from /v1/models of {_names(silent)}")
    return AdapterReport(fields, False, "Loading", "; ".join(parts))
