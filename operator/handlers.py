"""Thin kopf handlers: every trigger runs the same level-triggered reconciliation.

Create/update/resume react at once to spec changes and to an operator restart; a timer resyncs each
InferenceService every few seconds, which refreshes status from its pods and drives the autoscaler.
"""

from __future__ import annotations

import logging
from typing import Any, TypedDict

import kopf
from kubernetes.client.exceptions import ApiException

from capstan.operator import api
from capstan.operator.cluster_client import ClusterClient, load_api_client
from capstan.operator.reconciler import OperatorConfig, Reconciler

ANNOTATION_PREFIX = "capstan.dev"


def _emit(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    # kopf walks any mapping (its dicts.walk); the annotation names only its own Body view of one
    kopf.event(body, type=type_, reason=reason, message=message[:1024])  # type: ignore[arg-type]


class _Resource(TypedDict):
    """What every handler is registered for: the InferenceService resource, in this registry."""

    group: str
    version: str
    plural: str
    registry: kopf.OperatorRegistry
    backoff: float


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    reconciler: Reconciler | None = None
    # Unexpected errors retry soon, not after kopf's default minute: the reconciliation is idempotent.
    resource = _Resource(group=api.GROUP, version=api.VERSION, plural=api.PLURAL, registry=registry, backoff=5)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # Same credentials as our own client: the pod's service account, or $KUBECONFIG.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        nonlocal reconciler
        # Bookkeeping in annotations keeps status ours alone and conventional.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"
        settings.posting.level = logging.WARNING  # our own Events say what happened; not every log line
        settings.watching.server_timeout = 60
        settings.scanning.disabled = True  # the resources are known; no cluster-wide CRD/namespace reads
        # A deleted service keeps kopf's finalizer until its resync timer has exited; caught mid-run, kopf looked
        # again only after its default 60 s, so `kubectl delete` hung a minute (tests/operator/test_deletion_e2e.py)
        settings.background.cancellation_polling = 1
        reconciler = Reconciler(ClusterClient(load_api_client()), config, _emit)

    def run(body: kopf.Body, autoscale: bool) -> None:
        assert reconciler is not None, "the startup handler builds the reconciler"
        try:
            reconciler.reconcile(dict(body), autoscale=autoscale)
        except ApiException as error:
            if error.status in (404, 409):  # deleted or changed under us: the next event reconciles again
                raise kopf.TemporaryError(f"retrying: {error.reason}", delay=1) from error
            raise kopf.TemporaryError(f"Kubernetes API error {error.status}: {error.reason}", delay=5) from error

    @kopf.on.resume(**resource)
    @kopf.on.create(**resource)
    @kopf.on.update(**resource)
    def on_change(body: kopf.Body, **_: Any) -> None:
        run(body, autoscale=False)

    @kopf.timer(**resource, interval=config.resync_seconds, initial_delay=config.resync_seconds)
    def resync(body: kopf.Body, **_: Any) -> None:
        run(body, autoscale=True)

    return registry
