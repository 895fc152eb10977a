"""The picker's Prometheus metrics (names: server/metric_names.py): what it answered and where it sent requests,
and the replicas and loads it picks among, read from the pool at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily

from ..gateway.replica_pool import ReplicaPool
from ..server import metric_names as names
from .endpoint_picker import endpoint_of


class PoolCollector:
    def __init__(self, pool: ReplicaPool):
        self.pool = pool

    def collect(self):
        # Scrapes run on the HTTP server's thread while the event loop changes the pool: read one snapshot.
        replicas = list(self.pool.replicas.values())
        ready = GaugeMetricFamily(names.PICKER_REPLICAS_READY, "Ready replicas per model.", labels=["model"])
        for model in sorted({m for r in replicas for m in r.models}):
            ready.add_metric([model], sum(1 for r in replicas if r.ready and model in r.models))
        yield ready
        load = GaugeMetricFamily(
            names.PICKER_REPLICA_LOAD, "Requests in flight or queued per endpoint, as picked on.", labels=["endpoint"]
        )
        for replica in replicas:
            load.add_metric([endpoint_of(replica.url)], replica.load().load)
        yield load


class PickerMetrics:
    def __init__(self, pool: ReplicaPool):
        self.registry = CollectorRegistry()
        self.registry.register(PoolCollector(pool))
        self.requests = Counter(
            names.PICKER_REQUESTS,
            "Requests answered by the picker, by model and result (picked, failed_open, or the HTTP status sent).",
            ["model", "result"],
            registry=self.registry,
        )
        self.picked = Counter(
            names.PICKER_PICKED, "Requests sent to each endpoint first.", ["endpoint"], registry=self.registry
        )
        self.streams = Gauge(names.PICKER_STREAMS, "ext_proc streams in progress.", registry=self.registry)
