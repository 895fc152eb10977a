"""`capstan-operator`: run the kopf operator that serves InferenceServices.

capstan-operator                              # all namespaces, liveness on :8080/healthz
capstan-operator --namespace team-a --namespace team-b
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import kopf

from capstan.operator.handlers import build_registry
from capstan.operator.pod_metrics import PodAddresses
from capstan.operator.reconciler import OperatorConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="capstan-operator", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--namespace",
        action="append",
        default=None,
        help="namespace to serve (repeatable; default: all; env CAPSTAN_WATCH_NAMESPACES, comma-separated)",
    )
    parser.add_argument(
        "--default-image",
        default=env("CAPSTAN_RUNTIME_IMAGE", OperatorConfig.default_image),
        help="runtime image for InferenceServices that name none",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=float(env("CAPSTAN_RESYNC_SECONDS", "10")),
        help="how often each InferenceService is re-read, its status refreshed and autoscaled",
    )
    parser.add_argument(
        "--liveness",
        default=env("CAPSTAN_LIVENESS_ENDPOINT", "http://0.0.0.0:8080/healthz"),
        help="kopf's liveness endpoint; empty to disable",
    )
    parser.add_argument(
        "--peering-name",
        default=env("CAPSTAN_PEERING_NAME", "capstan"),
        help="kopf peering object shared by the operator's replicas",
    )
    parser.add_argument("--standalone", action="store_true", help="no peering: for a single local process")
    parser.add_argument(
        "--priority", type=int, default=None, help="peering priority (default: start time, so the newest replica leads)"
    )
    parser.add_argument(
        "--log-level", default=env("CAPSTAN_LOG_LEVEL", "info"), choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--gateway-url",
        default=env("CAPSTAN_GATEWAY_URL", ""),
        help="OpenAI base URL of `capstan gateway`, reported in each InferenceService's status.url "
        "(empty: the service's own URL)",
    )
    parser.add_argument(
        "--test-pod-addresses",
        default=env("CAPSTAN_TEST_POD_ADDRESSES", ""),
        help="TESTS ONLY: read metrics from these host:port addresses instead of pod IPs",
    )
    args = parser.parse_args(argv)
    if args.namespace is None:
        args.namespace = [n for n in env("CAPSTAN_WATCH_NAMESPACES", "").split(",") if n]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kopf.configure(verbose=args.log_level == "debug")
    logging.getLogger().setLevel(args.log_level.upper())
    config = OperatorConfig(
        default_image=args.default_image,
        resync_seconds=args.resync_seconds,
        pod_addresses=PodAddresses([a for a in args.test_pod_addresses.split(",") if a]),
        gateway_url=args.gateway_url or None,
    )
    # Equal priorities make kopf freeze every replica; distinct start times leave exactly one active.
    priority = args.priority if args.priority is not None else time.time_ns() // 1_000_000
    kopf.run(
        registry=build_registry(config),
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering_name,
        priority=priority,
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
