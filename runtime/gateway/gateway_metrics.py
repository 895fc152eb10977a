"""The gateway's own Prometheus metrics (names: server/metric_names.py): what it answered, retried and held, and
the replicas and loads it routes over, read from the pool at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..server import metric_names as names
from ..server.metrics import TTFT_BUCKETS
from .hold_queue import HoldQueue
from .replica_pool import ReplicaPool


class PoolCollector:
    def __init__(self, pool: ReplicaPool, holds: HoldQueue):
        self.pool, self.holds = pool, holds

    def collect(self):
        ready = GaugeMetricFamily(names.GATEWAY_REPLICAS_READY, "Ready replicas per model.", labels=["model"])
        for model in self.pool.all_models():
            ready.add_metric([model], len(self.pool.ready_for(model)))
        yield ready
        load = GaugeMetricFamily(
            names.GATEWAY_REPLICA_LOAD, "Requests in flight or queued per replica, as routed on.", labels=["replica"]
        )
        for replica in self.pool.replicas.values():
            load.add_metric([replica.url], replica.load().load)
        yield load
        yield GaugeMetricFamily(names.GATEWAY_HELD, "Requests waiting for a ready replica.", value=self.holds.held)
        yield CounterMetricFamily(
            names.GATEWAY_HOLD_REFUSED, "Held requests refused (queue full or timed out).", value=self.holds.refused
        )


class GatewayMetrics:
    def __init__(self, pool: ReplicaPool, holds: HoldQueue):
        self.registry = CollectorRegistry()
        self.registry.register(PoolCollector(pool, holds))
        self.requests = Counter(
            names.GATEWAY_REQUESTS,
            "Answered requests by model and status code.",
            ["model", "code"],
            registry=self.registry,
        )
        self.retries = Counter(
            names.GATEWAY_RETRIES,
            "Requests sent to another replica after failing before their first byte.",
            ["model"],
            registry=self.registry,
        )
        self.broken = Counter(
            names.GATEWAY_BROKEN_OFF,
            "Responses a replica broke off after their first byte (not retried).",
            registry=self.registry,
        )
        self.routed = Counter(
            names.GATEWAY_ROUTED, "Requests sent to each replica.", ["replica"], registry=self.registry
        )
        self.time_to_first_byte = Histogram(
            names.GATEWAY_TIME_TO_FIRST_BYTE,
            "Seconds from arrival to the upstream response's headers, holding and retries included.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
