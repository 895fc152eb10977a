"""Which replicas exist, and which models exist even with no replica (an InferenceService scaled to zero).

Two sources: a static list of `[MODEL=]URL` (tests, and running outside a cluster), or the Kubernetes API:
every InferenceService (its served model name and its LoRA adapters' names) and the ready endpoints of its
EndpointSlices (the slices of the Service the operator renders carry that Service's labels, so one label selector
finds them all). Which replica has which adapter loaded is the replicas' own word (replica_pool.py); the spec only
says that a name exists, so a request for an adapter still loading waits rather than getting a 404.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol, cast

log = logging.getLogger("capstan.gateway")


@dataclass(frozen=True)
class Target:
    url: str  # http://host:port
    model: str | None = None  # the model it is known to serve before it answers /v1/models


@dataclass(frozen=True)
class ServiceRef:
    """The InferenceService behind a model name: where the gateway signals demand for it."""

    namespace: str
    name: str


class Discovery(Protocol):
    services: dict[str, ServiceRef]

    async def discover(self) -> tuple[list[Target], set[str]]:
        """The replicas that exist now, and every model name that exists (with or without replicas)."""


def parse_replica(text: str) -> Target:
    """'MODEL=http://host:port' or 'http://host:port' (models then come from the replica's /v1/models)."""
    model, _, url = text.rpartition("=") if "=" in text.split("://")[0] else ("", "", text)
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--replica {text!r}: expected [MODEL=]http://host:port")
    return Target(url.rstrip("/"), model or None)


class StaticDiscovery:
    def __init__(self, targets: list[Target]):
        self.targets = targets
        self.services: dict[str, ServiceRef] = {}

    async def discover(self) -> tuple[list[Target], set[str]]:
        return self.targets, {t.model for t in self.targets if t.model}


class EndpointSliceDiscovery:
    """InferenceServices and their EndpointSlices, listed each round (level-triggered, like the operator)."""

    def __init__(self, namespaces: list[str]):
        from kubernetes import client

        from capstan.operator.cluster_client import load_api_client

        api_client = load_api_client()
        self._custom = client.CustomObjectsApi(api_client)
        self._discovery = client.DiscoveryV1Api(api_client)
        self.namespaces = namespaces  # empty: all
        self.services: dict[str, ServiceRef] = {}
        self._warned: set[tuple[str, ServiceRef]] = set()

    def _list_services(self) -> list[dict]:
        from capstan.operator import api

        # The client annotates the decoded JSON as object; a list call returns the list as a dict.
        if not self.namespaces:
            listed = self._custom.list_cluster_custom_object(api.GROUP, api.VERSION, api.PLURAL)
            return cast(dict[str, Any], listed)["items"]
        return [
            item
            for ns in self.namespaces
            for item in cast(
                dict[str, Any], self._custom.list_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL)
            )["items"]
        ]

    def _list_slices(self) -> list:
        from capstan.operator.render import INSTANCE_LABEL

        if not self.namespaces:
            return self._discovery.list_endpoint_slice_for_all_namespaces(label_selector=INSTANCE_LABEL).items
        return [
            s
            for ns in self.namespaces
            for s in self._discovery.list_namespaced_endpoint_slice(ns, label_selector=INSTANCE_LABEL).items
        ]

    def _discover(self) -> tuple[list[Target], set[str]]:
        from capstan.operator.model_source import served_model_name
        from capstan.operator.render import INSTANCE_LABEL

        models: dict[tuple[str, str], str] = {}
        current: dict[str, ServiceRef] = {}  # every name clients may send -> its InferenceService
        for item in self._list_services():
            meta, spec = item["metadata"], item.get("spec", {})
            model, ref = spec.get("model", {}), ServiceRef(meta["namespace"], meta["name"])
            if "uri" not in model:
                continue
            models[(ref.namespace, ref.name)] = model.get("servedName") or served_model_name(model["uri"])
            names = [models[(ref.namespace, ref.name)]]
            names += [a["name"] for a in spec.get("adapters", []) if isinstance(a, dict) and a.get("name")]
            for served in names:
                if current.setdefault(served, ref) != ref:
                    self._warn_shared(served, current[served], ref)
        self.services.clear()  # in place: the demand signal holds this dict
        self.services.update(current)
        targets = []
        for endpoint_slice in self._list_slices():
            owner = (endpoint_slice.metadata.namespace, (endpoint_slice.metadata.labels or {}).get(INSTANCE_LABEL))
            ports = [p.port for p in endpoint_slice.ports or [] if p.name == "http" and p.port]
            if owner not in models or not ports:
                continue
            for endpoint in endpoint_slice.endpoints or []:
                conditions = endpoint.conditions
                if conditions is not None and conditions.ready is False:
                    continue
                host = endpoint.addresses[0]
                host = f"[{host}]" if ":" in host else host
                targets.append(Target(f"http://{host}:{ports[0]}", models[owner]))
        return targets, set(current)

    def _warn_shared(self, name: str, first: ServiceRef, second: ServiceRef) -> None:
        """Two InferenceServices claim one model or adapter name: requests go to whichever replicas list it."""
        if (name, second) not in self._warned:
            self._warned.add((name, second))
            log.warning(
                "model name %r is claimed by %s/%s and %s/%s: give adapters and models names unique in the cluster",
                name,
                first.namespace,
                first.name,
                second.namespace,
                second.name,
            )

    async def discover(self) -> tuple[list[Target], set[str]]:
        return await asyncio.to_thread(self._discover)
