"""Prometheus metrics: engine gauges and counters read from engine.stats() at scrape time (the engine core sends them
with every step), plus the latency histograms and finish-reason counter the server observes per request (added up
over every frontend process with --api-server-count). Names: metric_names.py."""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from . import metric_names as names

# Buckets in the range vLLM uses: TTFT from a few ms (cached prefix) to minutes (a long queue).
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # no *_created series: they double the scrape and nothing here reads them


class EngineCollector:
    """Turns one engine.stats() snapshot into Prometheus families on every scrape."""

    def __init__(self, engine):
        self._engine = engine

    def collect(self):
        s = self._engine.stats()
        yield GaugeMetricFamily(names.REQUESTS_RUNNING, "Sequences in the running batch.", value=s.running)
        yield GaugeMetricFamily(names.REQUESTS_WAITING, "Requests queued, not yet scheduled.", value=s.waiting)
        usage = s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0
        yield GaugeMetricFamily(names.KV_CACHE_USAGE, "Used KV-cache pages / all pages (0..1).", value=usage)
        yield GaugeMetricFamily(names.KV_PAGES_FREE, "Free KV-cache pages.", value=s.kv_pages_total - s.kv_pages_used)
        yield GaugeMetricFamily(names.KV_PAGES_TOTAL, "KV-cache pages in the pool.", value=s.kv_pages_total)
        yield GaugeMetricFamily(
            names.PROGRAMS_COMPILING,
            "Step programs the warm-up still compiles in the background while serving (0: all compiled).",
            value=s.programs_compiling,
        )
        hit_rate = s.prefix_cache_hit_tokens / s.prefix_cache_queried_tokens if s.prefix_cache_queried_tokens else 0.0
        yield GaugeMetricFamily(
            names.PREFIX_CACHE_HIT_RATE,
            "Prompt tokens found in the prefix cache / looked up, "
            "since start (use the two counters for a windowed rate).",
            value=hit_rate,
        )
        for name, doc, value in (
            (names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queried_tokens),
            (names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.", s.prefix_cache_hit_tokens),
            (names.PREEMPTIONS, "Sequences preempted (recomputed later) when KV pages ran out.", s.preemptions),
            (names.PROMPT_TOKENS, "Prompt tokens of requests admitted to the engine.", s.prompt_tokens),
            (names.GENERATION_TOKENS, "Tokens generated.", s.generation_tokens),
            (names.SPEC_DRAFT_TOKENS, "Tokens proposed by speculative decoding.", s.spec_draft_tokens),
            (
                names.SPEC_ACCEPTED_TOKENS,
                "Proposed tokens the target model verified (accepted).",
                s.spec_accepted_tokens,
            ),
            (names.SPEC_DRAFTS, "Proposals verified (a sequence's tokens proposed for one step).", s.spec_drafts),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield from _host_tier_families(s)
        yield from _lora_families(s)
        per_pos = CounterMetricFamily(
            names.SPEC_ACCEPTED_PER_POS,
            "Accepted proposed tokens by their position in "
            "the proposal (0 first): where acceptance falls off, for choosing K.",
            labels=["position"],
        )
        for position, value in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([str(position)], value)
        yield per_pos


def _host_tier_families(s):
    """The prefix cache's host-memory tier (--kv-offloading-size); the device tier is prefix_cache_*."""
    usage = s.kv_offload_pages_used / s.kv_offload_pages_total if s.kv_offload_pages_total else 0.0
    yield GaugeMetricFamily(names.KV_OFFLOAD_USAGE, "Host-tier K/V pages held / its pages (0..1).", value=usage)
    yield CounterMetricFamily(
        names.KV_OFFLOAD_QUERIES,
        "Prompt tokens the device prefix cache lacked, looked up in the host tier.",
        value=s.kv_offload_queried_tokens,
    )
    yield CounterMetricFamily(
        names.KV_OFFLOAD_HITS,
        "Prompt tokens copied back from the host tier instead of recomputed.",
        value=s.kv_offload_hit_tokens,
    )
    moved = CounterMetricFamily(
        names.KV_OFFLOAD_BYTES, "K/V bytes copied between the device and the host tier.", labels=["direction"]
    )
    moved.add_metric(["to_host"], s.kv_offload_bytes_to_host)
    moved.add_metric(["to_device"], s.kv_offload_bytes_to_device)
    yield moved
    yield CounterMetricFamily(
        names.KV_OFFLOAD_FAILED_LOADS,
        "Copies back from the host tier that failed or were late (their pages were recomputed).",
        value=s.kv_offload_failed_loads,
    )
    yield GaugeMetricFamily(
        names.KV_OFFLOAD_SAVED_SECONDS,
        "Estimated prefill seconds the host tier saved (restored "
        "tokens at the measured prefill cost), less the time its copies took.",
        value=s.kv_offload_saved_seconds,
    )


def _lora_families(s):
    """LoRA adapters' device slots (docs/lora.md); zeros without --enable-lora."""
    yield GaugeMetricFamily(
        names.LORA_SLOTS_USED, "LoRA adapter slots held by running sequences.", value=s.lora_slots_used
    )
    yield GaugeMetricFamily(
        names.LORA_SLOTS_TOTAL, "LoRA adapter slots on the device (--max-loras).", value=s.lora_slots_total
    )
    yield CounterMetricFamily(
        names.LORA_SLOT_LOADS,
        "LoRA adapters written into a device slot (the first time, and swaps).",
        value=s.lora_slot_loads,
    )
    yield GaugeMetricFamily(
        names.LORA_REQUESTS_WAITING,
        "Sequences waiting for their LoRA adapter's slot (every slot held by other adapters' running sequences).",
        value=s.lora_requests_waiting,
    )


class ServerMetrics:
    """One registry per app, so several servers in one process (tests) do not collide."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self._engine_collector = EngineCollector(engine)
        self.registry.register(self._engine_collector)
        self.ttft = Histogram(
            names.TIME_TO_FIRST_TOKEN,
            "Seconds from arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            names.INTER_TOKEN_LATENCY,
            "Seconds between consecutive generated tokens.",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            names.E2E_REQUEST_LATENCY,
            "Seconds from arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            names.REQUESTS_FINISHED,
            "Finished choices by finish_reason (stop, length, abort).",
            ["finish_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort"):
            self.finished.labels(finish_reason=reason)

    def render(self) -> bytes:
        if not os.environ.get(MULTIPROC_ENV):
            return generate_latest(self.registry)
        # several frontends (--api-server-count): every process's histograms and counters, from their files; the
        # engine's families once, from the stats the core sent this process
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(self._engine_collector)
        return generate_latest(registry)


def share_across_processes(directory: str) -> None:
    """Frontend processes started after this, and this one, count into files under `directory`, which every
    frontend's /metrics adds up (prometheus-client's multiprocess mode). Before any ServerMetrics exists."""
    os.environ[MULTIPROC_ENV] = directory
    values.ValueClass = values.get_value_class()  # chosen when prometheus_client was imported: choose again


class RequestTimer:
    """Latency of one engine request, fed with each delta RequestOutput as it arrives."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self._metrics = metrics
        self.arrival = arrival
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None

    def observe(self, output) -> None:
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        now = time.perf_counter()
        if new_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                self._metrics.ttft.observe(now - self.arrival)
                new_tokens -= 1
            elif self._last_token_at is not None:
                # A delta may carry several tokens (several choices, or several steps): spread its gap over them.
                gap = (now - self._last_token_at) / new_tokens
                for _ in range(new_tokens):
                    self._metrics.itl.observe(gap)
            self._last_token_at = now
        for choice in output.outputs:
            if choice.finish_reason is not None:
                self._metrics.finished.labels(finish_reason=choice.finish_reason).inc()
        if output.finished:
            self._metrics.e2e.observe(now - self.arrival)

    def aborted(self, unfinished_choices: int) -> None:
        if unfinished_choices:
            self._metrics.finished.labels(finish_reason="abort").inc(unfinished_choices)
            self._metrics.e2e.observe(time.perf_counter() - self.arrival)
