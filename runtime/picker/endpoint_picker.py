"""Which pod of the pool a request goes to: the replicas that serve its model (or adapter) and are ready, as
runtime/gateway's ReplicaPool knows them (their /ready, /v1/models and /metrics: queue depth, KV-cache use), ordered
by the gateway's routing policy (prefix affinity with bounded load). The first is the destination; the next few
are the fallbacks Envoy tries on a retry.

When the picker knows of no ready replica, the failure mode decides: FailClose answers 503; FailOpen sends the
request to an endpoint the pool lists anyway (Kubernetes thinks it ready), and its own answer reaches the client.
A model that no ready replica serves is a 404 either way: the picker then knows the pool's models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..gateway.kv_subscriber import KVEventSubscriber
from ..gateway.replica_pool import Replica, ReplicaPool
from ..gateway.routing_policy import RoutingPolicy
from .pick_request import PickError, PickRequest
from .picker_flags import FailureMode

log = logging.getLogger("capstan.picker")
MAX_ENDPOINTS = 3  # the destination and two fallbacks: a retry that fails on all three has a bigger problem


@dataclass(frozen=True)
class Pick:
    replicas: list[Replica]  # preferred first
    failed_open: bool = False  # no ready replica known: an endpoint of the pool, unscored

    @property
    def endpoints(self) -> list[str]:
        return [endpoint_of(r.url) for r in self.replicas]


def endpoint_of(url: str) -> str:
    """http://10.0.0.7:8000 -> 10.0.0.7:8000, the `ip:port` form GIE's header and metadata carry."""
    return url.split("://", 1)[-1].rstrip("/")


class EndpointPicker:
    def __init__(
        self,
        pool: ReplicaPool,
        policy: RoutingPolicy,
        failure_mode: FailureMode | None = None,
        kv_events: KVEventSubscriber | None = None,  # --routing kv-events: the replicas' cached pages
    ):
        self.pool, self.policy, self._failure_mode, self.kv_events = pool, policy, failure_mode, kv_events

    @property
    def failure_mode(self) -> FailureMode:
        """--failure-mode when given, else the InferencePool's (its discovery reads it), else FailClose."""
        from_pool = getattr(self.pool.discovery, "failure_mode", None)
        return self._failure_mode or from_pool or FailureMode.FAIL_CLOSE

    async def kv_scores(self, request: PickRequest) -> dict[str, int] | None:
        """The ready replicas' cached leading pages of the request's prompt, where their KV events say (None:
        unknown, and the policy picks by prompt hashing). Never fails the request."""
        if self.kv_events is None or request.model is None or request.body is None:
            return None
        urls = [r.url for r in self.pool.ready_for(request.model)]
        if len(urls) < 2:
            return None
        auth = {"authorization": request.authorization} if request.authorization else {}
        try:
            return await self.kv_events.scores(request.model, request.path, request.body, urls, auth)
        except Exception as error:  # noqa: BLE001 - scores are advice: the request is picked by hashing instead
            log.warning("KV-event scores failed (%s); picking by prompt hashing", error)
            return None

    def pick(self, request: PickRequest, scores: dict[str, int] | None = None) -> Pick:
        allowed = [
            r for r in self.pool.replicas.values() if request.subset is None or endpoint_of(r.url) in request.subset
        ]
        if request.subset is not None and not allowed:
            raise PickError(
                503,
                "none of the endpoints the Gateway allows for this request (its subset hint) is in the pool",
                code="no_ready_endpoint",
            )
        model = request.model
        candidates = [r for r in allowed if r.ready and (model is None or model in r.models)]
        if candidates:
            return Pick(self._order(request.key, candidates, scores))
        knows_models = any(r.ready for r in self.pool.replicas.values())
        if model is not None and knows_models and not self.pool.serves(model):
            raise PickError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        if self.failure_mode == FailureMode.FAIL_OPEN and allowed:
            return Pick([min(allowed, key=lambda r: (r.in_flight, r.url))], failed_open=True)
        what = f"`{model}`" if model else "this pool"
        raise PickError(
            503,
            f"no ready replica of {what} (endpoints in the pool: {len(allowed)}); retry shortly",
            code="no_ready_endpoint",
        )

    def _order(self, key: str, candidates: list[Replica], scores: dict[str, int] | None) -> list[Replica]:
        """The policy's choice, then its choice among the rest, and so on: MAX_ENDPOINTS in order of preference."""
        by_url = {r.url: r for r in candidates}
        ordered: list[Replica] = []
        while by_url and len(ordered) < MAX_ENDPOINTS:
            chosen = self.policy.choose(key, [r.load() for r in by_url.values()], scores)
            assert chosen is not None, "a policy chooses among a non-empty list"
            ordered.append(by_url.pop(chosen.url))
        return ordered

    def replica_at(self, endpoint: str) -> Replica | None:
        return next((r for r in self.pool.replicas.values() if endpoint_of(r.url) == endpoint), None)
