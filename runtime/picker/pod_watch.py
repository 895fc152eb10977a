"""The pods that match one label selector in one namespace, kept current by a list and then a watch (the Kubernetes
client's, on a thread), so the picker reads its pool's pods from memory instead of listing them every round. A
watch that ends is resumed from its resourceVersion; one the API server no longer serves (410 Gone) or that fails
starts over with a fresh list."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

log = logging.getLogger("capstan.picker")
WATCH_SECONDS = 60  # one watch request's length, after which it is resumed: the thread sees a stop within this
RETRY_SECONDS = 2.0  # after a failed list or watch
GONE = 410  # the watch's resourceVersion is older than the API server keeps: list again


class PodWatch:
    def __init__(self, core_api: Any, namespace: str, selector: str):
        self._core, self.namespace, self.selector = core_api, namespace, selector
        self._pods: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._listed = threading.Event()
        self._stopped = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name=f"pod-watch {namespace} {selector}", daemon=True)
        self._thread.start()

    def pods(self, timeout: float) -> list[dict[str, Any]]:
        """The pods as last seen; waits up to `timeout` for the first list (TimeoutError if it has not come)."""
        if not self._listed.wait(timeout):
            raise TimeoutError(f"listing the pods of {self.namespace} matching {self.selector} took over {timeout} s")
        with self._lock:
            return list(self._pods.values())

    def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        while not self._stopped.is_set():
            try:
                version = self._list()
                while not self._stopped.is_set():
                    self._watch = watch.Watch()
                    for event in self._watch.stream(
                        self._core.list_namespaced_pod,
                        self.namespace,
                        label_selector=self.selector,
                        resource_version=version,
                        timeout_seconds=WATCH_SECONDS,
                        allow_watch_bookmarks=True,
                    ):
                        version = self._apply(event) or version
                    version = self._watch.resource_version or version
            except ApiException as error:
                if error.status != GONE and not self._stopped.is_set():
                    log.warning("watching the pods of %s failed (%s); listing again", self.namespace, error)
                    self._stopped.wait(RETRY_SECONDS)
            except Exception as error:  # noqa: BLE001 - the API server restarted, a network blip: list again soon
                if self._stopped.is_set():  # stopped mid-read: the stream's end is ours
                    return
                log.warning("watching the pods of %s failed (%s); listing again", self.namespace, error)
                self._stopped.wait(RETRY_SECONDS)

    def _list(self) -> str:
        listed = self._core.list_namespaced_pod(self.namespace, label_selector=self.selector, _preload_content=False)
        body = json.loads(listed.data)
        with self._lock:
            self._pods = {p["metadata"]["name"]: p for p in body.get("items", [])}
        self._listed.set()
        return body["metadata"]["resourceVersion"]

    def _apply(self, event: dict[str, Any]) -> str | None:
        kind, pod = event["type"], event.get("raw_object") or {}  # the client raises ERROR events
        meta = pod.get("metadata", {})
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(meta.get("name"), None)
            elif kind in ("ADDED", "MODIFIED"):
                self._pods[meta["name"]] = pod
        return meta.get("resourceVersion")
