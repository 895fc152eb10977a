"""The replicas the gateway may send to, kept fresh in the background: which are ready, which models each serves
(its /v1/models, read every round: LoRA adapters are loaded and unloaded while it runs), and how loaded each is
(its own /metrics: running, waiting, KV-cache use), plus the requests this gateway has open on each. Discovery
says which replicas exist; this pool says which can take a request now."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..server import metric_names
from .discovery import Discovery, Target
from .routing_policy import ReplicaLoad

log = logging.getLogger("capstan.gateway")
PROBE_TIMEOUT_SECONDS = 2.0


@dataclass
class Replica:
    url: str
    declared_model: str | None = None  # from discovery (the InferenceService's name for it, or MODEL=URL)
    ready: bool = False
    served_models: tuple[str, ...] = ()  # from its /v1/models: the base model's names and its LoRA adapters
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # those cards by id (an adapter's has `parent`)
    others: float = 0.0  # running + waiting at the last scrape, less this gateway's requests then: other clients'
    kv_cache_usage: float = 0.0
    in_flight: int = 0  # requests this gateway has open there: exact and immediate

    @property
    def models(self) -> set[str]:
        return set(self.served_models) | ({self.declared_model} if self.declared_model else set())

    def forget(self, model: str) -> None:
        """It answered model_not_found for `model` (an adapter unloaded since the last probe): until its next
        /v1/models lists it again, send that model elsewhere."""
        self.served_models = tuple(m for m in self.served_models if m != model)
        self.cards.pop(model, None)

    def load(self) -> ReplicaLoad:
        # Ours count as they are now; a scrape up to a poll interval old would count finished ones and miss new ones.
        return ReplicaLoad(self.url, self.in_flight + self.others, self.kv_cache_usage)


def model_cards(listing: Any) -> dict[str, dict[str, Any]]:
    """A /v1/models body -> its cards by id; anything that is not a card is skipped."""
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list):
        return {}
    return {c["id"]: c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"]}


def parse_gauges(text: str) -> dict[str, float]:
    wanted = {metric_names.REQUESTS_RUNNING, metric_names.REQUESTS_WAITING, metric_names.KV_CACHE_USAGE}
    return {f.name: sum(s.value for s in f.samples) for f in text_string_to_metric_families(text) if f.name in wanted}


@dataclass
class ReplicaPool:
    discovery: Discovery
    poll_interval: float = 1.0
    replicas: dict[str, Replica] = field(default_factory=dict)
    known_models: set[str] = field(default_factory=set)  # models that exist, with or without ready replicas

    def __post_init__(self):
        self._changed = asyncio.Event()
        self._client = httpx.AsyncClient(timeout=PROBE_TIMEOUT_SECONDS)

    def ready_for(self, model: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.ready and model in r.models]

    def serves(self, model: str) -> bool:
        return model in self.known_models or any(model in r.models for r in self.replicas.values())

    def all_models(self) -> list[str]:
        return sorted(self.known_models | {m for r in self.replicas.values() for m in r.models})

    def card(self, model: str) -> dict[str, Any] | None:
        """A replica's /v1/models card for `model` (ready replicas first), e.g. an adapter's with its `parent`."""
        for replica in sorted(self.replicas.values(), key=lambda r: not r.ready):
            if model in replica.cards:
                return replica.cards[model]
        return None

    def mark_failed(self, replica: Replica) -> None:
        """A request could not reach it: take it out until a probe finds it ready again."""
        replica.ready = False

    async def wait_ready(self, model: str, timeout: float) -> bool:
        """Until a replica of `model` is ready (True) or `timeout` seconds pass (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.ready_for(model):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return bool(self.ready_for(model))
        return True

    def _apply_targets(self, targets: list[Target], models: set[str]) -> None:
        urls = {t.url for t in targets}
        for url in list(self.replicas):
            if url not in urls:
                del self.replicas[url]
        for target in targets:
            replica = self.replicas.setdefault(target.url, Replica(target.url))
            replica.declared_model = target.model
        self.known_models = models | {t.model for t in targets if t.model}

    async def _probe(self, replica: Replica) -> None:
        try:
            ready = (await self._client.get(f"{replica.url}/ready")).status_code == 200
            if ready:
                replica.cards = model_cards((await self._client.get(f"{replica.url}/v1/models")).json())
                replica.served_models = tuple(replica.cards)
            if ready:
                ours = replica.in_flight
                gauges = parse_gauges((await self._client.get(f"{replica.url}/metrics")).text)
                total = gauges.get(metric_names.REQUESTS_RUNNING, 0.0) + gauges.get(metric_names.REQUESTS_WAITING, 0.0)
                replica.others = max(0.0, total - min(ours, replica.in_flight))
                replica.kv_cache_usage = gauges.get(metric_names.KV_CACHE_USAGE, 0.0)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            log.debug("replica %s did not answer its probes: %s", replica.url, error)
            ready = False
        if ready != replica.ready:
            log.info("replica %s is %s", replica.url, "ready" if ready else "not ready")
        replica.ready = ready

    async def refresh(self) -> None:
        """One round: ask discovery, probe every replica, wake whoever waits if readiness changed."""
        before = self._routable()
        try:
            targets, models = await self.discovery.discover()
            self._apply_targets(targets, models)
        except Exception as error:  # noqa: BLE001 - keep the last known replicas; the next round retries
            log.warning("discovery failed, keeping %d known replica(s): %s", len(self.replicas), error)
        await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values())))
        if self._routable() != before:  # a replica became ready, or loaded an adapter: wake held requests
            self._changed.set()
            self._changed = asyncio.Event()

    def _routable(self) -> dict[str, tuple[bool, frozenset[str]]]:
        return {url: (r.ready, frozenset(r.models)) for url, r in self.replicas.items()}

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.poll_interval)

    async def close(self) -> None:
        await self._client.aclose()
