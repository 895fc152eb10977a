"""`capstan gateway`'s flags -> a running gateway: discovery, pool, hold queue, policy, demand, served by uvicorn
with the same SIGTERM drain as `capstan serve`."""

from __future__ import annotations

import argparse
import asyncio
import logging

import uvicorn

from ..server.access_log import quiet_probes
from ..server.drain import DrainingServer
from ..server.header_limits import HeaderLimitedProtocol
from ..server.tls import serving_certificate
from .access import Access, UpstreamKeys
from .budgets import Budgets
from .client_keys import KeyRing
from .demand import DemandSignal
from .discovery import Discovery, EndpointSliceDiscovery, StaticDiscovery, parse_replica
from .hold_queue import HoldQueue
from .kv_index import KVEventIndex
from .kv_subscriber import KVEventSubscriber
from .proxy import Gateway, build_gateway_app
from .replica_pool import ReplicaPool
from .routing_policy import POLICIES, KVEventPolicy, PrefixAffinityPolicy

log = logging.getLogger("capstan.gateway")


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
