"""`capstan picker`'s flags -> a running endpoint picker: the replicas (an InferencePool's pods, or --replica URLs)
kept fresh by runtime/gateway's ReplicaPool, Envoy's ext_proc on --grpc-port, the gRPC health service on
--grpc-health-port, Prometheus metrics on --metrics-port. The flags are the reference picker's (GIE's EPP), so a
Deployment rendered for it needs no change. SIGTERM: health turns NOT_SERVING, open streams get a grace period."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from ..gateway.discovery import Discovery, StaticDiscovery, parse_replica
from ..gateway.kv_index import KVEventIndex
from ..gateway.kv_subscriber import KVEventSubscriber
from ..gateway.replica_pool import ReplicaPool
from ..gateway.routing_policy import (
    POLICIES,
    KVEventPolicy,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
)
from .endpoint_picker import EndpointPicker, FailureMode
from .external_processor import ExternalProcessor
from .inference_pool import InferencePoolDiscovery
from .picker_metrics import PickerMetrics

log = logging.getLogger("capstan.picker")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)  # GIE's: liveness, readiness, the ext_proc service
MESSAGE_OVERHEAD_BYTES = 1 << 20  # beyond --max-body-bytes, what one ext_proc message may carry: headers, metadata
STOP_GRACE_SECONDS = 5.0  # open streams (requests being answered) get this long after SIGTERM


@dataclass
class Picker:
    pool: ReplicaPool
    picker: EndpointPicker
    metrics: PickerMetrics
    processor: ExternalProcessor


def build_picker(args: argparse.Namespace) -> Picker:
    if (
        args.load_factor < 1.0
        or args.prefix_chars < 1
        or args.poll_interval <= 0
        or args.max_body_bytes < 1
        or args.body_timeout <= 0
    ):
        raise ValueError(
            "--load-factor must be at least 1, --prefix-chars and --max-body-bytes at least 1, --poll-interval and "
            "--body-timeout above 0"
        )
    if bool(args.replica) == bool(args.pool_name):
        raise ValueError("name the replicas: --pool-name NAME (in a cluster) or --replica URL (repeatable), not both")
    discovery: Discovery
    if args.replica:
        targets = [parse_replica(r) for r in args.replica]
        if any(t.model for t in targets):
            raise ValueError("--replica takes a URL: the picker reads each replica's models from its /v1/models")
        discovery = StaticDiscovery(targets)
    else:
        from kubernetes.config import ConfigException

        try:
            discovery = InferencePoolDiscovery(args.pool_name, args.pool_namespace)
        except ConfigException as error:
            raise ValueError(
                f"--pool-name needs the Kubernetes API ({error}): run it in a cluster, or set KUBECONFIG"
            ) from None
    pool = ReplicaPool(discovery, poll_interval=args.poll_interval)
    policy = _policy(args.routing, args.load_factor)
    mode = FailureMode(args.failure_mode) if args.failure_mode else None
    kv_events = (
        KVEventSubscriber(pool, KVEventIndex(args.kv_events_resync)) if args.routing == KVEventPolicy.name else None
    )
    picker = EndpointPicker(pool, policy, mode, kv_events)
    metrics = PickerMetrics(pool)
    processor = ExternalProcessor(picker, metrics, args.max_body_bytes, args.prefix_chars, args.body_timeout)
    return Picker(pool, picker, metrics, processor)


def _policy(name: str, load_factor: float) -> RoutingPolicy:
    policy_class = POLICIES[name]
    if issubclass(policy_class, PrefixAffinityPolicy):  # prefix and kv-events: the load bound's factor
        return policy_class(load_factor)
    assert policy_class is RoundRobinPolicy, "the other policies take the load bound's factor"
    return RoundRobinPolicy()


async def serve_picker(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """Serve until `stop` is set."""
    built = build_picker(args)
    health_servicer = health.aio.HealthServicer()
    for service in HEALTH_SERVICES:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    # A BUFFERED body comes in one message: let one over the limit arrive, to be answered 413 rather than cut off.
    receive_limit = args.max_body_bytes + MESSAGE_OVERHEAD_BYTES
    health_server = grpc.aio.server()
    ext_proc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", receive_limit)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(built.processor, ext_proc_server)
    try:  # every port bound before anything serves: a port in use is one clear error, not a half-started picker
        _listen(health_server, args.host, args.grpc_health_port)
        _listen(ext_proc_server, args.host, args.grpc_port)
        try:
            metrics_server, metrics_thread = start_http_server(
                args.metrics_port, addr=args.host, registry=built.metrics.registry
            )
        except OSError as error:
            raise ValueError(f"cannot listen on {args.host}:{args.metrics_port} ({error.strerror})") from None
    except ValueError as error:
        await asyncio.gather(health_server.stop(None), ext_proc_server.stop(None), built.pool.close())
        raise ValueError(f"{error}: is another process on that port?") from None
    await health_server.start()
    await ext_proc_server.start()
    await built.pool.refresh()  # the pool is known before the picker says it is ready
    for service in HEALTH_SERVICES:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    poller = asyncio.create_task(built.pool.run())
    kv_events = asyncio.create_task(built.picker.kv_events.run()) if built.picker.kv_events else None
    source = f"InferencePool {args.pool_namespace}/{args.pool_name}" if args.pool_name else "static replicas"
    log.info(
        "picker: ext_proc on %s:%d, health on %d, metrics on %d, %d endpoint(s) of %s, %s",
        args.host,
        args.grpc_port,
        args.grpc_health_port,
        args.metrics_port,
        len(built.pool.replicas),
        source,
        built.picker.failure_mode.value,
    )
    try:
        await stop.wait()
    finally:
        await health_servicer.enter_graceful_shutdown()  # NOT_SERVING: the Gateway stops sending streams here
        await ext_proc_server.stop(STOP_GRACE_SECONDS)
        await health_server.stop(0)
        poller.cancel()
        if kv_events:
            kv_events.cancel()
        await built.pool.close()
        if isinstance(built.pool.discovery, InferencePoolDiscovery):
            built.pool.discovery.close()
        metrics_server.shutdown()
        metrics_thread.join(5)


def _listen(server: grpc.aio.Server, host: str, number: int) -> None:
    address = f"[{host}]:{number}" if ":" in host else f"{host}:{number}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where older releases returned 0
        bound = 0
    if bound == 0:
        raise ValueError(f"cannot listen on {address}")


def run_picker(args: argparse.Namespace) -> int:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve_picker(args, stop)

    asyncio.run(main())
    return 0
