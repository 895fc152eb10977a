"""`capstan gateway`'s flags -> a running gateway: discovery, pool, hold queue, policy, demand, served by uvicorn
with the same SIGTERM drain as `capstan serve`."""

from __future__ import annotations

import argparse
import asyncio
import logging

import uvicorn

from ..arg_types import port
from ..server.access_log import quiet_probes
from ..server.drain import DrainingServer
from ..server.header_limits import HeaderLimitedProtocol
from ..server.tls import add_tls_flags, serving_certificate
from .access import Access, UpstreamKeys
from .budgets import DEFAULT_WINDOW_SECONDS, Budgets
from .client_keys import KeyRing
from .demand import DemandSignal
from .discovery import Discovery, EndpointSliceDiscovery, StaticDiscovery, parse_replica
from .hold_queue import DEFAULT_HOLD_TIMEOUT_SECONDS, DEFAULT_MAX_HELD, HoldQueue
from .kv_index import DEFAULT_RESYNC_SECONDS, KVEventIndex
from .kv_subscriber import KVEventSubscriber
from .proxy import Gateway, build_gateway_app
from .replica_pool import ReplicaPool
from .routing_policy import DEFAULT_LOAD_FACTOR, DEFAULT_PREFIX_CHARS, POLICIES, KVEventPolicy, PrefixAffinityPolicy

log = logging.getLogger("capstan.gateway")
DEFAULT_PORT = 8080


def add_gateway_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="[MODEL=]URL",
        help="a replica to route to (repeatable); MODEL= lets requests for it wait while it starts. "
        "Without any: discover InferenceServices and their EndpointSlices through the Kubernetes API",
    )
    parser.add_argument(
        "--namespace", action="append", default=[], help="with discovery: namespace to serve (repeatable; default: all)"
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=port, default=DEFAULT_PORT)
    parser.add_argument(
        "--routing",
        choices=sorted(POLICIES),
        default=PrefixAffinityPolicy.name,
        help="prefix: consistent hashing of the prompt's prefix with bounded load; kv-events: the replica that "
        "holds the longest run of the prompt's KV pages (from the replicas' KV events: `capstan serve "
        "--kv-events-config`), under the same bound, else as prefix; round-robin: what a Kubernetes Service does",
    )
    parser.add_argument(
        "--kv-events-resync",
        type=float,
        default=DEFAULT_RESYNC_SECONDS,
        help="with --routing kv-events: seconds a replica whose events were lost is routed by prompt hashing",
    )
    parser.add_argument(
        "--prefix-chars",
        type=int,
        default=DEFAULT_PREFIX_CHARS,
        help="leading characters of the prompt (or chat) that choose the replica",
    )
    parser.add_argument(
        "--load-factor",
        type=float,
        default=DEFAULT_LOAD_FACTOR,
        help="a replica takes at most this times the mean load before requests spill (>= 1)",
    )
    parser.add_argument(
        "--poll-interval", type=float, default=1.0, help="seconds between reads of each replica's /ready and /metrics"
    )
    parser.add_argument(
        "--max-held",
        type=int,
        default=DEFAULT_MAX_HELD,
        help="requests that may wait for a model with no ready replica; more get 503",
    )
    parser.add_argument(
        "--hold-timeout",
        type=float,
        default=DEFAULT_HOLD_TIMEOUT_SECONDS,
        help="seconds a request waits for a replica (scale from zero) before a 503 with Retry-After",
    )
    parser.add_argument(
        "--max-attempts", type=int, default=3, help="replicas tried for a request that fails before its first byte"
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=60.0, help="seconds in-flight requests get to finish after SIGTERM"
    )
    parser.add_argument(
        "--client-keys",
        action="append",
        default=[],
        metavar="PATH",
        help="YAML of client keys, models and budgets (docs/gateway.md), a file or a folder (a mounted "
        "Secret; repeatable); read again when it changes. Without it the gateway is open",
    )
    parser.add_argument(
        "--upstream-keys",
        default=None,
        metavar="PATH",
        help='with --client-keys: YAML `MODEL: KEY` ("*": any model), the key sent to that model\'s '
        "replicas instead of the client's",
    )
    parser.add_argument(
        "--budget-window",
        type=float,
        default=DEFAULT_WINDOW_SECONDS,
        help="seconds of one budget window; the per-minute budgets scale to it",
    )
    parser.add_argument(
        "--budget-shares",
        type=int,
        default=1,
        help="gateway replicas sharing the budgets: each enforces 1/N of every budget",
    )
    add_tls_flags(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_gateway(args: argparse.Namespace) -> Gateway:
    if args.load_factor < 1.0:
        raise ValueError(f"--load-factor {args.load_factor}: must be at least 1 (the bound is this times the mean)")
    if args.prefix_chars < 1 or args.max_attempts < 1 or args.max_held < 0 or args.poll_interval <= 0:
        raise ValueError(
            "--prefix-chars and --max-attempts must be at least 1, --max-held at least 0, --poll-interval above 0"
        )
    discovery: Discovery
    if args.replica:
        discovery = StaticDiscovery([parse_replica(r) for r in args.replica])
    else:
        from kubernetes.config import ConfigException

        try:
            discovery = EndpointSliceDiscovery(args.namespace)
        except ConfigException as error:
            raise ValueError(
                f"no --replica given, and no Kubernetes API to discover replicas from ({error}): run it "
                "in a cluster, set KUBECONFIG, or name the replicas with --replica"
            ) from None
    pool = ReplicaPool(discovery, poll_interval=args.poll_interval)
    policy = (
        POLICIES[args.routing](args.load_factor)
        if issubclass(POLICIES[args.routing], PrefixAffinityPolicy)
        else POLICIES[args.routing]()
    )
    access_parts = _access_parts(args)
    gateway = Gateway(
        pool=pool,
        holds=HoldQueue(pool, args.max_held, args.hold_timeout),
        policy=policy,
        demand=DemandSignal(discovery.services),
        prefix_chars=args.prefix_chars,
        max_attempts=args.max_attempts,
    )
    if args.routing == KVEventPolicy.name:
        gateway.kv_events = KVEventSubscriber(pool, KVEventIndex(args.kv_events_resync))
    if access_parts:
        gateway.access = Access(*access_parts, registry=gateway.metrics.registry)
    return gateway


def _access_parts(args: argparse.Namespace) -> tuple[KeyRing, Budgets, UpstreamKeys] | None:
    if not args.client_keys:
        if args.upstream_keys:
            raise ValueError(
                "--upstream-keys needs --client-keys: without client keys anyone could use the "
                "replicas' keys through the gateway"
            )
        return None
    return KeyRing(args.client_keys), Budgets(args.budget_window, args.budget_shares), UpstreamKeys(args.upstream_keys)


def run_gateway(args: argparse.Namespace) -> int:
    certificate = serving_certificate(args.ssl_keyfile, args.ssl_certfile)
    gateway = build_gateway(args)
    app = build_gateway_app(gateway)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
        **(certificate.uvicorn_options() if certificate else {}),
        http=HeaderLimitedProtocol,  # bounded request heads (431, 408)
    )
    quiet_probes()  # successful probes at DEBUG
    on_start, watches = None, []  # the list keeps the certificate's watch task referenced
    if certificate:
        certificate.attach(config)
        on_start = lambda server: watches.append(asyncio.ensure_future(certificate.watch()))  # noqa: E731
    source = (
        f"{len(args.replica)} static replica(s)"
        if args.replica
        else f"InferenceServices in {', '.join(args.namespace) or 'all namespaces'}"
    )
    log.info(
        "gateway on %s://%s:%d routing %s over %s",
        "https" if certificate else "http",
        args.host,
        args.port,
        args.routing,
        source,
    )
    DrainingServer(config, gateway.drain, args.drain_timeout, on_start=on_start).run()
    return 0
