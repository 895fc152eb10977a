"""When each step of a pod's graceful removal happened, measured from outside as an operator would see it:
the API server marks the pod deleted, its endpoint turns not-ready, kube-proxy drops it from the node's
iptables rules, the server logs SIGTERM (after the preStop delay) and then the end of its drain.

Wall-clock times (time.time()); polling resolution is that of one `kubectl get` on a busy machine (~0.5 s)."""

from __future__ import annotations

import datetime
import subprocess
import threading
import time
from dataclasses import dataclass, field

from control_plane import kubectl_path


@dataclass
class PodRemoval:
    name: str
    ip: str
    deleted: float | None = None
    endpoint_not_ready: float | None = None
    proxy_rule_removed: float | None = None
    sigterm: float | None = None
    drained: float | None = None
    gone: float | None = None
    log: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.deleted is None:
            return f"{self.name}: kept"

        def at(moment):
            return "never" if moment is None or self.deleted is None else f"+{moment - self.deleted:.1f}s"

        return (
            f"{self.name}: deleted, endpoint not ready {at(self.endpoint_not_ready)}, "
            f"kube-proxy rule gone {at(self.proxy_rule_removed)}, SIGTERM {at(self.sigterm)}, "
            f"drained {at(self.drained)}, pod gone {at(self.gone)}"
        )


def _log_time(line: str) -> float:
    stamp = line.split(" ", 1)[0]  # kubectl logs --timestamps: RFC 3339 with nanoseconds
    return datetime.datetime.fromisoformat(stamp[:26] + "+00:00").timestamp()


class DrainTimeline:
    def __init__(self, cluster, node, namespace: str, pods: list[dict]):
        self.cluster, self.node, self.namespace = cluster, node, namespace
        self.pods = {p["metadata"]["name"]: PodRemoval(p["metadata"]["name"], p["status"]["podIP"]) for p in pods}
        self.stopping = threading.Event()
        self._threads = [threading.Thread(target=self._poll, daemon=True)]
        self._followers: list[subprocess.Popen] = []
        for removal in self.pods.values():
            self._threads.append(threading.Thread(target=self._follow_log, args=(removal,), daemon=True))

    def __enter__(self) -> DrainTimeline:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for follower in self._followers:
            if follower.poll() is None:
                follower.kill()
        for thread in self._threads:
            thread.join(timeout=30)

    def _poll(self) -> None:
        while not self.stopping.is_set():
            try:
                self._sample()
            except Exception as error:  # noqa: BLE001 - a failed sample is skipped; the next one counts
                print(f"[drain timeline] sample failed: {error}", flush=True)
            self.stopping.wait(0.25)

    def _sample(self) -> None:
        now = time.time()
        pods = {p["metadata"]["name"]: p for p in self.cluster.get_json("pods", "-n", self.namespace)["items"]}
        slices = self.cluster.get_json("endpointslices", "-n", self.namespace)["items"]
        ready_ips = {
            address
            for s in slices
            for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready")
            for address in e["addresses"]
        }
        rules = self.node.network.run("iptables-save", "-t", "nat", check=False).stdout
        for removal in self.pods.values():
            pod = pods.get(removal.name)
            if removal.deleted is None and (pod is None or pod["metadata"].get("deletionTimestamp")):
                removal.deleted = now
            if removal.deleted is None:
                continue
            if removal.endpoint_not_ready is None and removal.ip not in ready_ips:
                removal.endpoint_not_ready = now
            if removal.proxy_rule_removed is None and f"{removal.ip}:" not in rules:
                removal.proxy_rule_removed = now
            if removal.gone is None and pod is None:
                removal.gone = now

    def _follow_log(self, removal: PodRemoval) -> None:
        follower = subprocess.Popen(
            [
                kubectl_path(),
                f"--kubeconfig={self.cluster.kubeconfig}",
                "logs",
                "-f",
                "--timestamps",
                "--since=1s",
                "-n",
                self.namespace,
                removal.name,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._followers.append(follower)
        assert follower.stdout is not None  # stdout=PIPE
        for line in follower.stdout:
            removal.log.append(line.rstrip())
            if "SIGTERM: draining" in line:
                removal.sigterm = _log_time(line)
            elif "drained in" in line or "drain timeout" in line:
                removal.drained = _log_time(line)
