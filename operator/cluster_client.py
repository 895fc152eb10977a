"""The operator's few calls to the Kubernetes API: server-side apply, reads, status patches."""

from __future__ import annotations

import json
import time
from typing import Any

import kubernetes
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from capstan.operator import api

FIELD_MANAGER = "capstan-operator"
DISCOVERY_SECONDS = 60.0  # how long the answer "does the cluster serve this API?" is reused

# kind -> (API path prefix, plural) for the kinds the operator owns or reads.
PATHS = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "Service": ("/api/v1", "services"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Pod": ("/api/v1", "pods"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),  # the GIE's CRD, where installed
    api.KIND: (f"/apis/{api.GROUP}/{api.VERSION}", api.PLURAL),
}


def load_api_client() -> ApiClient:
    """In a pod: its service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return ApiClient()


class ClusterClient:
    def __init__(self, api_client: ApiClient):
        self.api_client = api_client
        self._served: dict[str, tuple[float, bool]] = {}

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        serialized = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            body=body,
            auth_settings=["BearerToken"],
            header_params={"Accept": "application/json", "Content-Type": content_type},
        )
        response = self.api_client.call_api(
            serialized[0], serialized[1], header_params=serialized[2], body=serialized[3], _request_timeout=30
        )
        response.read()
        return self.api_client.response_deserialize(response, {"2XX": "object"}).data  # raises ApiException

    @staticmethod
    def _path(kind: str, namespace: str, name: str | None = None) -> str:
        prefix, plural = PATHS[kind]
        return f"{prefix}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager; returns the live object."""
        meta = obj["metadata"]
        return self._call(
            "PATCH",
            self._path(obj["kind"], meta["namespace"], meta["name"]),
            body=json.dumps(obj),
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", self._path(kind, namespace, name))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._call("DELETE", self._path(kind, namespace, name))
        except ApiException as error:
            if error.status != 404:
                raise

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self._call("GET", self._path(kind, namespace), query=[("labelSelector", label_selector)])["items"]

    def serves(self, api_version: str) -> bool:
        """Whether the cluster serves group/version (e.g. a CRD's), from API discovery, reused for a minute."""
        checked, served = self._served.get(api_version, (0.0, False))
        if time.monotonic() - checked < DISCOVERY_SECONDS:
            return served
        try:
            self._call("GET", f"/apis/{api_version}")
            served = True
        except ApiException as error:
            if error.status != 404:
                raise
            served = False
        self._served[api_version] = (time.monotonic(), served)
        return served

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._call(
            "PATCH",
            self._path(api.KIND, namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )
