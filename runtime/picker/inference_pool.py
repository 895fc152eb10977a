"""The pods of one InferencePool (Gateway API Inference Extension v1: inference.networking.k8s.io/v1,
`inferencepools`): its spec.selector.matchLabels picks pods in its namespace, and every ready pod serves on each of
spec.targetPorts. The pool is read each round (level-triggered, as runtime/gateway/discovery.py reads
EndpointSlices), its selector's pods are listed once and then watched (pod_watch.py): a pod that turns ready or goes
away, or a pool whose selector changes, is seen within a poll interval.

This is a Discovery for runtime/gateway's ReplicaPool: it says which endpoints exist; the pool's probes say which
can take a request and which models (and LoRA adapters) each serves.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from ..gateway.discovery import ServiceRef, Target
from .picker_flags import FailureMode
from .pod_watch import PodWatch

log = logging.getLogger("capstan.picker")
GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
LIST_TIMEOUT_SECONDS = 10.0  # the first list of a selector's pods; a round that waits longer fails and is retried


def label_selector(pool: dict[str, Any]) -> str:
    """spec.selector.matchLabels as a label selector; an empty one would take every pod of the namespace."""
    labels = (pool.get("spec", {}).get("selector") or {}).get("matchLabels") or {}
    if not labels:
        name = pool.get("metadata", {}).get("name", "?")
        raise ValueError(
            f"InferencePool {name}: spec.selector.matchLabels is empty; name the model server pods' labels"
        )
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def target_ports(pool: dict[str, Any]) -> list[int]:
    ports = [p.get("number") for p in pool.get("spec", {}).get("targetPorts") or [] if isinstance(p, dict)]
    numbers = [p for p in ports if isinstance(p, int) and 0 < p < 65536]
    if not numbers:
        name = pool.get("metadata", {}).get("name", "?")
        raise ValueError(f"InferencePool {name}: spec.targetPorts has no port number; set the model servers' port")
    return numbers


def failure_mode(pool: dict[str, Any]) -> FailureMode:
    """spec.endpointPickerRef.failureMode; GIE's default is FailClose."""
    mode = (pool.get("spec", {}).get("endpointPickerRef") or {}).get("failureMode")
    return FailureMode(mode) if mode in {m.value for m in FailureMode} else FailureMode.FAIL_CLOSE


def pod_is_ready(pod: dict[str, Any]) -> bool:
    status, meta = pod.get("status") or {}, pod.get("metadata") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pool_targets(pool: dict[str, Any], pods: list[dict[str, Any]]) -> list[Target]:
    """Every ready pod's IP on each target port, as http:// URLs (the replicas' probes and the picked `ip:port`)."""
    ports = target_ports(pool)
    targets = []
    for pod in pods:
        if pod_is_ready(pod):
            ip = pod["status"]["podIP"]
            host = f"[{ip}]" if ":" in ip else ip
            targets += [Target(f"http://{host}:{port}") for port in ports]
    return targets


class InferencePoolDiscovery:
    def __init__(self, name: str, namespace: str):
        from kubernetes import client

        from capstan.operator.cluster_client import load_api_client

        self.api_client = load_api_client()
        self._custom = client.CustomObjectsApi(self.api_client)
        self._core = client.CoreV1Api(self.api_client)
        self.name, self.namespace = name, namespace
        self.services: dict[str, ServiceRef] = {}  # scale from zero is the gateway's; the picker signals none
        self.failure_mode: FailureMode | None = None  # the pool's, once read
        self._pods: PodWatch | None = None  # the pool's selector's pods, watched

    def _discover(self) -> tuple[list[Target], set[str]]:
        pool = cast(
            dict[str, Any],
            self._custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name),
        )
        self.failure_mode = failure_mode(pool)
        selector = label_selector(pool)
        if self._pods is None or self._pods.selector != selector:  # first round, or the pool's selector changed
            if self._pods is not None:
                self._pods.stop()
            self._pods = PodWatch(self._core, self.namespace, selector)
        return pool_targets(pool, self._pods.pods(LIST_TIMEOUT_SECONDS)), set()

    def close(self) -> None:
        if self._pods is not None:
            self._pods.stop()

    async def discover(self) -> tuple[list[Target], set[str]]:
        return await asyncio.to_thread(self._discover)
