"""The gateway's HTTP front: OpenAI's /v1 routes, proxied to a replica chosen by model, then by the routing policy;
responses stream through as they come, never buffered.

A request that fails before its first byte (connection refused or reset, or a replica answering 429/502/503) goes
to another replica, up to `max_attempts`; once a response has begun it is the client's, so nothing is ever sent
twice. A model with no ready replica holds its requests (hold_queue.py) and signals demand (demand.py). A client
that hangs up, at any point, closes the upstream connection within DISCONNECT_CHECK_SECONDS, and the replica aborts
the request and frees its pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from ..server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from ..server.drain import Drain, DrainMiddleware
from ..server.error_body import APIError, error_body, error_response
from ..server.json_body import BodyError, parse_json_body
from ..server.metrics import CONTENT_TYPE
from .access import CLIENT_CLOSED, Access, Admission
from .demand import DemandSignal
from .gateway_metrics import GatewayMetrics
from .hold_queue import HoldQueue
from .kv_subscriber import KVEventSubscriber
from .prompt_count import count_prompts
from .replica_pool import Replica, ReplicaPool
from .request_cost import GenerationFields, generation_fields, prompt_pieces, worst_case
from .routing_policy import DEFAULT_PREFIX_CHARS, RoutingPolicy, routing_key
from .usage_meter import UsageMeter, ask_for_usage

log = logging.getLogger("capstan.gateway")
PROXIED_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
)
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
DISCONNECT_CHECK_SECONDS = 0.25  # how often a request held, or waiting for its answer's headers, looks for its client
UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)  # a long generation may be silent


class ClientGone(APIError):
    """The client hung up while its request was at a replica (it may have run for a while)."""


@dataclass
class Gateway:
    pool: ReplicaPool
    holds: HoldQueue
    policy: RoutingPolicy
    demand: DemandSignal
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    max_attempts: int = 3
    access: Access | None = None  # client keys and budgets; None: open, Authorization passes through
    kv_events: KVEventSubscriber | None = None  # --routing kv-events: the replicas' cached pages, from their events

    def __post_init__(self):
        self.metrics = GatewayMetrics(self.pool, self.holds)
        self.drain = Drain()
        self.client = httpx.AsyncClient(
            timeout=UPSTREAM_TIMEOUT, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
        )

    def choose(self, model: str, key: str, tried: set[str], scores: dict[str, int] | None = None) -> Replica | None:
        candidates = {r.url: r for r in self.pool.ready_for(model) if r.url not in tried}
        chosen = self.policy.choose(key, [r.load() for r in candidates.values()], scores)
        return candidates[chosen.url] if chosen else None

    async def kv_scores(self, model: str, path: str, body: dict, headers: dict) -> dict[str, int] | None:
        """The ready replicas' cached leading pages of this request's prompt, where their KV events say (None:
        unknown, and the policy routes by prompt hashing). Never fails the request."""
        urls = [r.url for r in self.pool.ready_for(model)]
        if self.kv_events is None or len(urls) < 2:
            return None
        auth = {"authorization": headers["authorization"]} if "authorization" in headers else {}
        try:
            return await self.kv_events.scores(model, path, body, urls, auth)
        except Exception as error:  # noqa: BLE001 - scoring is advice: the request routes by hashing instead
            log.warning("KV-event scores failed (%s); routing by prompt hashing", error)
            return None

    async def forward(self, request: Request, path: str) -> Response:
        arrival = time.perf_counter()
        access = self.access
        client = access.authenticate(request.headers.get("authorization")) if access else None
        raw = await request.body()
        body = parse_request_body(raw)
        model = body["model"]
        try:
            return await self._forward(request, path, model, body, raw, arrival, client)
        except RecursionError:  # a body within json's depth but too deep to walk or write again
            raise APIError(400, "the request body nests too deeply to parse") from None

    async def _forward(
        self, request: Request, path: str, model: str, body: dict, raw: bytes, arrival: float, client
    ) -> Response:
        access = self.access
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
        if access is None or client is None:  # no client keys: open (authenticate returns a key or refuses)
            return await self._route(request, path, model, body, raw, headers, arrival, None, None)
        access.check(client, model)  # 403 before 404: a key learns nothing of others' models
        fields = generation_fields(path, body)
        headers.pop("authorization", None)  # the client's key stays here; replicas get the service's own
        if upstream_authorization := access.upstream.authorization(model):
            headers["authorization"] = upstream_authorization
        tokens, prompt_tokens = 0, 0
        if access.counts_tokens(client):
            tokens, prompt_tokens = await self._worst_case(request, path, model, body, fields, headers)
        admission = access.admit(client, tokens, prompt_tokens)
        upstream_body, client_wants_usage = ask_for_usage(body, fields)
        if upstream_body is not body:
            raw = json.dumps(upstream_body).encode()
        meter = UsageMeter(client_wants_usage=client_wants_usage)
        try:
            response = await self._route(request, path, model, body, raw, headers, arrival, admission, meter)
        except APIError as error:
            access.settle(admission, error.status, meter, fields, reached=isinstance(error, ClientGone))
            raise
        except BaseException:
            access.settle(admission, CLIENT_CLOSED, meter, fields, reached=True)
            raise
        if not isinstance(response, StreamingResponse):  # answered here, nothing relayed: no tokens
            access.settle(admission, response.status_code, meter, fields, reached=False)
        response.headers.update(access.budgets.headers(client))
        return response

    async def _worst_case(
        self, request: Request, path: str, model: str, body: dict, fields: GenerationFields | None, headers: dict
    ) -> tuple[int, int]:
        """The request's worst case in tokens and its prompt tokens, counted by a replica of the model (held for
        one, as the request itself would be, when none is ready)."""
        pieces = prompt_pieces(path, body)
        if not pieces:  # tokenize, detokenize: nothing generated, nothing charged
            return 0, 0
        self._require(model)
        self.demand.note(model)
        while (replica := self.choose(model, routing_key(body, self.prefix_chars), set())) is None:
            await self._hold(request, model)
        auth = {"authorization": headers["authorization"]} if "authorization" in headers else {}
        try:
            prompts, max_model_len = await count_prompts(self.client, replica.url, model, auth, pieces)
        except LookupError as error:
            raise APIError(502, str(error), code="upstream_unavailable", headers={"Retry-After": "1"}) from None
        return worst_case(path, fields, prompts, max_model_len), sum(prompts)

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
        self._require(model)
        self.demand.note(model)
        key = routing_key(body, self.prefix_chars)
        scores = await self.kv_scores(model, path, body, headers)
        tried: set[str] = set()
        attempts = 0
        last: tuple[int, bytes, dict] | None = None
        while attempts < self.max_attempts:
            replica = self.choose(model, key, tried, scores)
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
                upstream = await self._send(
                    request, self.client.build_request("POST", f"{replica.url}{path}", content=raw, headers=headers)
                )
            except APIError:
                replica.in_flight -= 1
                raise
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
            if meter is not None:
                meter.streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")
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

    def _require(self, model: str) -> None:
        if not self.pool.serves(model):
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def _hold(self, request: Request, model: str) -> None:
        """Wait for a replica of `model`; a client that hangs up stops waiting (and leaves the queue) at once."""
        waiting = asyncio.ensure_future(self.holds.wait_for_replica(model))
        try:
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=DISCONNECT_CHECK_SECONDS)
                if not waiting.done() and await request.is_disconnected():
                    raise APIError(
                        CLIENT_CLOSED,
                        "the client closed the connection while its request was held",
                        code="client_closed",
                    )
            waiting.result()
        finally:
            waiting.cancel()

    async def _send(self, request: Request, upstream_request: httpx.Request) -> httpx.Response:
        """Send, and wait for the answer's headers (a whole answer's time, when it does not stream) while watching
        the client: one that hangs up cancels the send, which closes the connection, and the replica aborts."""
        sending = asyncio.ensure_future(self.client.send(upstream_request, stream=True))
        try:
            while not sending.done():
                await asyncio.wait({sending}, timeout=DISCONNECT_CHECK_SECONDS)
                if not sending.done() and await request.is_disconnected():
                    raise ClientGone(CLIENT_CLOSED, "the client closed the connection before the answer")
            return sending.result()
        finally:
            if not sending.done():
                sending.cancel()
                await asyncio.wait({sending})

    async def _relay(
        self,
        upstream: httpx.Response,
        replica: Replica,
        admission: Admission | None = None,
        meter: UsageMeter | None = None,
    ):
        ended = False  # the upstream's answer ended (whole, or broken off by the replica): else the client left
        try:
            async for chunk in upstream.aiter_raw():
                if meter is not None:
                    chunk = meter.feed(chunk)
                if chunk:
                    yield chunk
            if meter is not None and (tail := meter.close()):
                yield tail
            ended = True
        except httpx.HTTPError as error:  # the replica died mid-response; part of it is the client's: no retry
            ended = True
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
            if admission is not None:
                assert self.access is not None and meter is not None, "an admitted request is metered"
                # a client that hangs up right after the last event it read ended its answer, not cut it short
                code = upstream.status_code if ended or meter.finished else CLIENT_CLOSED
                self.access.settle(admission, code, meter, None, reached=True)
            with anyio.CancelScope(shield=True):  # a client that left cancelled us: close the upstream all the same
                await upstream.aclose()

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


def parse_request_body(raw: bytes) -> dict:
    """The body by the server's own rule (json_body.py): what it refuses with a 400, the gateway refuses alike."""
    try:
        body = parse_json_body(raw)
    except BodyError as error:
        raise APIError(400, error.detail) from None
    except ValueError as error:
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
        kv_events = asyncio.create_task(gateway.kv_events.run()) if gateway.kv_events else None
        key_watch = asyncio.create_task(gateway.access.watch()) if gateway.access else None
        try:
            yield
        finally:
            poller.cancel()
            if kv_events:
                kv_events.cancel()
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
