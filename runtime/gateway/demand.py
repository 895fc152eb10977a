"""The demand signal for scale from zero: the gateway stamps the time of a recent request on the model's
InferenceService (an annotation, refreshed at most every DEMAND_REFRESH_SECONDS per model). The operator reads it
level-triggered: a service at minReplicas 0 with a recent stamp gets one replica, and goes back to zero only once
no request has come for its idle period. Outside a cluster (static replicas) there is nothing to scale."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from capstan.operator import api

from .discovery import ServiceRef

log = logging.getLogger("capstan.gateway")


class DemandSignal:
    def __init__(self, services: dict[str, ServiceRef] | None = None):
        self.services = services if services is not None else {}  # the discovery's, kept current by it
        self._stamped: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self._custom: Any = None  # kubernetes.client.CustomObjectsApi, made on first use (untyped)

    def note(self, model: str) -> None:
        """A request for `model` arrived: refresh its stamp if the last one is getting old (never blocks)."""
        now = time.time()
        ref = self.services.get(model)
        if ref is None or now - self._stamped.get(model, 0.0) < api.DEMAND_REFRESH_SECONDS:
            return
        self._stamped[model] = now
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._stamp, ref, now))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _stamp(self, ref: ServiceRef, now: float) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        from capstan.operator.cluster_client import load_api_client

        if self._custom is None:
            self._custom = client.CustomObjectsApi(load_api_client())
        patch = {"metadata": {"annotations": {api.DEMAND_ANNOTATION: f"{now:.0f}"}}}
        try:
            self._custom.patch_namespaced_custom_object(
                api.GROUP, api.VERSION, ref.namespace, api.PLURAL, ref.name, patch
            )
        except ApiException as error:
            log.warning("could not signal demand on %s/%s: %s %s", ref.namespace, ref.name, error.status, error.reason)
