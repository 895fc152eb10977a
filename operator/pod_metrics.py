"""The one seam between the autoscaler and the pods: read each ready pod's /metrics over HTTP.

Pods are reached at podIP:8000. For tests on a cluster whose pods are fake (kwok), the operator can be
told to read real `capstan serve` processes instead (`--test-pod-addresses`, off by default).
"""

from __future__ import annotations

import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from capstan.operator.autoscaler import PodLoad
from capstan.operator.render import SERVER_PORT
from capstan.runtime.server import metric_names

log = logging.getLogger(__name__)
FETCH_TIMEOUT_SECONDS = 2.0


def parse_load(text: str) -> PodLoad:
    """Prometheus text exposition -> the gauges the autoscaler reads (absent gauges read as 0)."""
    gauges = {metric_names.REQUESTS_RUNNING: 0.0, metric_names.REQUESTS_WAITING: 0.0, metric_names.KV_CACHE_USAGE: 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in gauges:
            gauges[family.name] = sum(sample.value for sample in family.samples)
    return PodLoad(
        running=gauges[metric_names.REQUESTS_RUNNING],
        waiting=gauges[metric_names.REQUESTS_WAITING],
        kv_cache_usage=gauges[metric_names.KV_CACHE_USAGE],
    )


def fetch_load(address: str) -> PodLoad | None:
    """GET http://address/metrics; None when the pod does not answer (it then counts as no sample)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=FETCH_TIMEOUT_SECONDS) as response:
            return parse_load(response.read().decode())
    except (OSError, ValueError) as error:
        log.info("no metrics from %s: %s", address, error)
        return None


class PodAddresses:
    """Where to reach each pod's server: its IP, or, in tests only, one of a fixed list of addresses."""

    def __init__(self, test_addresses: list[str] | None = None):
        self.test_addresses = test_addresses or []

    def resolve(self, pods: list[dict[str, Any]]) -> list[str]:
        return list(self.by_pod(pods).values())

    def by_pod(self, pods: list[dict[str, Any]]) -> dict[str, str]:
        """Pod name -> address, in name order; pods with no IP yet are left out."""
        ordered = sorted(pods, key=lambda p: p["metadata"]["name"])
        if self.test_addresses:  # pod i (by name) -> test address i, round robin
            return {
                p["metadata"]["name"]: self.test_addresses[i % len(self.test_addresses)] for i, p in enumerate(ordered)
            }
        return {
            p["metadata"]["name"]: f"{p['status']['podIP']}:{SERVER_PORT}"
            for p in ordered
            if p.get("status", {}).get("podIP")
        }


def fetch_loads(addresses: list[str]) -> list[PodLoad]:
    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        return [load for load in pool.map(fetch_load, addresses) if load is not None]
