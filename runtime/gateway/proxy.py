"""The gateway's HTTP front: OpenAI's /v1 routes, proxied to a replica chosen by model, then by the routing policy;
responses stream through as they come, never buffered.

A request that fails before its first byte (connection refused or reset, or a replica answering 429/502/503) goes
to another replica, up to `max_attempts`; once a response has begun it is the client's, so nothing is ever sent
twice. A model with no ready replica holds its requests (hold_queue.py) and signals demand (demand.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from ..server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from ..server.drain import Drain, DrainMiddleware
from ..server.error_body import APIError, error_body, error_response
from ..server.metrics import CONTENT_TYPE
from .access import Access, Admission
from .demand import DemandSignal
from .gateway_metrics import GatewayMetrics
from .hold_queue import HoldQueue
from .replica_pool import Replica, ReplicaPool
from .routing_policy import DEFAULT_PREFIX_CHARS, RoutingPolicy, routing_key
from .usage_meter import UsageMeter, ask_for_usage

log = logging.getLogger("capstan.gateway")
PROXIED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")
RETRYABLE_STATUS = {429, 502, 503}  # the replica took nothing on: queue full, draining, not ready
FORWARDED_REQUEST_HEADERS = {"authorization", "content-type", "accept", "traceparent", "tracestate", "x-request-id"}
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "proxy-authenticate",
    "proxy-authorization",
}
DISCONNECT_CHECK_SECONDS = 0.5  # how often a held request looks whether its client is still there
UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)  # a long generation may be silent


@dataclass
class Gateway:
    pool: ReplicaPool
    holds: HoldQueue
    policy: RoutingPolicy
    demand: DemandSignal
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    max_attempts: int = 3
    access: Access | None = None  # client keys and budgets; None: open, Authorization passes through

    def __post_init__(self):
        self.metrics = GatewayMetrics(self.pool, self.holds)
        self.drain = Drain()
        self.client = httpx.AsyncClient(
            timeout=UPSTREAM_TIMEOUT, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
        )

    def choose(self, model: str, key: str, tried: set[str]) -> Replica | None:
        candidates = {r.url: r for r in self.pool.ready_for(model) if r.url not in tried}
        chosen = self.policy.choose(key, [r.load() for r in candidates.values()])
        return candidates[chosen.url] if chosen else None

    async def forward(self, request: Request, path: str) -> Response:
        arrival = time.perf_counter()
        access = self.access
        client = access.authenticate(request.headers.get("authorization")) if access else None
        raw = await request.body()
        body = _parse_body(raw)
        model = body["model"]
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
        if access is None or client is None:  # no client keys: open (authenticate returns a key or refuses)
            return await self._route(request, path, model, body, raw, headers, arrival, None, None)
        admission = access.admit(client, model)  # 403 before 404: a key learns nothing of others' models
        upstream_body, client_wants_usage = ask_for_usage(body)
        if upstream_body is not body:
            raw = json.dumps(upstream_body).encode()
        headers.pop("authorization", None)  # the client's key stays here; replicas get the service's own
        if admission.upstream_authorization:
            headers["authorization"] = admission.upstream_authorization
        meter = UsageMeter(streaming=bool(body.get("stream")), client_wants_usage=client_wants_usage)
        try:
            response = await self._route(request, path, model, body, raw, headers, arrival, admission, meter)
        except APIError as error:
            access.finish(admission, error.status, 0, 0)
            raise
        except BaseException:
            access.finish(admission, 499, 0, 0)
            raise
        if not isinstance(response, StreamingResponse):  # answered here, nothing relayed: no tokens
            access.finish(admission, response.status_code, 0, 0)
        response.headers.update(access.budgets.headers(client))
        return response

    async def _route(
        self,
        request: Request,
        path: str,
        model: str,
        body: dict,
        raw: bytes,
        headers: dict,
        arrival: float,
        admission: Admission | None,
        meter: UsageMeter | None,
    ) -> Response:
        if not self.pool.serves(model):
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        self.demand.note(model)
        key = routing_key(body, self.prefix_chars)
        tried: set[str] = set()
        attempts = 0
        last: tuple[int, bytes, dict] | None = None
        while attempts < self.max_attempts:
            replica = self.choose(model, key, tried)
            if replica is None:
                if self.pool.ready_for(model):  # every ready replica answered this request 429: pass that on
                    break
                await self._hold(request, model)  # none ready: scaling from zero, or every replica restarting
                tried.clear()  # a replica that failed and is ready again may be tried again
                continue
            if attempts:
                self.metrics.retries.labels(model=model).inc()
            attempts += 1
            tried.add(replica.url)
            replica.in_flight += 1
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", f"{replica.url}{path}", content=raw, headers=headers), stream=True
                )
            except httpx.TransportError as error:
                replica.in_flight -= 1
                log.warning("replica %s failed before a byte (%s); trying another", replica.url, error)
                self.pool.mark_failed(replica)
                last = (502, b"", {})
                continue
            if upstream.status_code == 404 and model != replica.declared_model:
                content = await upstream.aread()
                await upstream.aclose()
                replica.in_flight -= 1
                last = (404, content, _response_headers(upstream))
                if _error_code(content) != "model_not_found":
                    break
                replica.forget(model)  # an adapter unloaded since the last probe: another replica may have it
                if not self.pool.serves(model):
                    break
                continue
            if upstream.status_code in RETRYABLE_STATUS and attempts < self.max_attempts:
                content = await upstream.aread()
                await upstream.aclose()
                replica.in_flight -= 1
                if upstream.status_code == 503:  # draining or not ready: skip it until a probe finds it ready
                    self.pool.mark_failed(replica)
                last = (upstream.status_code, content, _response_headers(upstream))
                continue
            self.metrics.routed.labels(replica=replica.url).inc()
            self.metrics.time_to_first_byte.observe(time.perf_counter() - arrival)
            self.metrics.requests.labels(model=model, code=str(upstream.status_code)).inc()
            return StreamingResponse(
                self._relay(upstream, replica, admission, meter),
                status_code=upstream.status_code,
                headers=_response_headers(upstream),
            )
        status, content, response_headers = last or (503, b"", {})
        self.metrics.requests.labels(model=model, code=str(status)).inc()
        if content:
            return Response(content, status_code=status, headers=response_headers)
        return error_response(
            502,
            f"{attempts} attempts on replicas of `{model}` failed before answering",
            code="upstream_unavailable",
            headers={"Retry-After": "1"},
        )

    async def _hold(self, request: Request, model: str) -> None:
        """Wait for a replica of `model`; a client that hangs up stops waiting (and leaves the queue) at once."""
        waiting = asyncio.ensure_future(self.holds.wait_for_replica(model))
        try:
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=DISCONNECT_CHECK_SECONDS)
                if not waiting.done() and await request.is_disconnected():
                    raise APIError(
                        499, "the client closed the connection while its request was held", code="client_closed"
                    )
            waiting.result()
        finally:
            waiting.cancel()

    async def _relay(
        self,
        upstream: httpx.Response,
        replica: Replica,
        admission: Admission | None = None,
        meter: UsageMeter | None = None,
    ):
        try:
            async for chunk in upstream.aiter_raw():
                if meter is not None:
                    chunk = meter.feed(chunk)
                if chunk:
                    yield chunk
            if meter is not None and (tail := meter.close()):
                yield tail
        except httpx.HTTPError as error:  # the replica died mid-response; part of it is the client's: no retry
            log.warning("replica %s broke off a response: %s", replica.url, error)
            self.metrics.broken.inc()
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                # As the server itself reports a failure mid-stream: an error event, then [DONE].
                body = error_body(
                    502,
                    f"the replica serving this stream stopped mid-response ({error}); the request "
                    "was not retried, as part of the answer had been sent",
                    code="upstream_broke_off",
                )
                yield b"\n\ndata: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            replica.in_flight -= 1
            await upstream.aclose()
            if admission is not None:
                assert self.access is not None and meter is not None, "an admitted request is metered"
                self.access.finish(admission, upstream.status_code, meter.prompt_tokens, meter.completion_tokens)

    async def list_models(self) -> dict:
        """Every model and adapter the gateway knows; a replica's own card where one lists it (an adapter's names
        its `parent`, the base model), else a plain one (a model whose replicas are not up)."""
        return {
            "object": "list",
            "data": [
                self.pool.card(m) or {"id": m, "object": "model", "created": 0, "owned_by": "capstan"}
                for m in self.pool.all_models()
            ],
        }


def _parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(400, f"malformed JSON body: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise APIError(
            400, "`model` is required: the name of the model to use (GET /v1/models lists them)", param="model"
        )
    return body


def _error_code(content: bytes) -> str | None:
    """The `code` of an OpenAI error body, or None."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def _response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}


def build_gateway_app(gateway: Gateway, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.pool.refresh()  # know the replicas before the first request
        poller = asyncio.create_task(gateway.pool.run())
        key_watch = asyncio.create_task(gateway.access.watch()) if gateway.access else None
        try:
            yield
        finally:
            poller.cancel()
            if key_watch:
                key_watch.cancel()
            await gateway.client.aclose()
            await gateway.pool.close()

    app = FastAPI(title="Capstan gateway", lifespan=lifespan)
    app.state.drain = gateway.drain

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        gateway.metrics.requests.labels(model="", code=str(exc.status)).inc()  # refused before any replica: no model
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)

    for route in PROXIED_ROUTES:

        async def proxied(request: Request, _path: str = route) -> Response:
            return await gateway.forward(request, _path)

        app.add_api_route(route, proxied, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        listed = await gateway.list_models()
        if gateway.access:  # with client keys: a key sees the models it may use, and nothing without one
            client = gateway.access.authenticate(request.headers.get("authorization"))
            listed["data"] = [m for m in listed["data"] if client.may_use(m["id"])]
        return listed

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if gateway.drain.draining:
            return error_response(503, "draining: the gateway is shutting down", code="draining")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(DrainMiddleware, drain=gateway.drain)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    return app
