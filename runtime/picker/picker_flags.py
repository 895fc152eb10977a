"""`capstan picker`'s flags and their defaults, light to import (no gRPC, no Envoy protos): `capstan`'s parser is
built at every command's start, serve's too."""

from __future__ import annotations

import argparse
import os
from enum import StrEnum

from ..arg_types import port
from ..gateway.kv_index import DEFAULT_RESYNC_SECONDS
from ..gateway.routing_policy import DEFAULT_LOAD_FACTOR, DEFAULT_PREFIX_CHARS, POLICIES, PrefixAffinityPolicy
from ..limits import DEFAULT_MAX_BODY_BYTES

BODY_TIMEOUT_SECONDS = 60.0  # a request whose next message takes longer is answered 408, so no stream waits forever


class FailureMode(StrEnum):
    """GIE's InferencePool spec.endpointPickerRef.failureMode."""

    FAIL_OPEN = "FailOpen"
    FAIL_CLOSE = "FailClose"


def add_picker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool-name", default=None, help="the InferencePool whose pods to pick among")
    parser.add_argument(
        "--pool-namespace",
        default=os.environ.get("POD_NAMESPACE") or os.environ.get("NAMESPACE") or "default",
        help="its namespace (default: $POD_NAMESPACE, else default)",
    )
    parser.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica to pick among, http://host:port (repeatable; instead of --pool-name, outside a cluster)",
    )
    parser.add_argument("--grpc-port", type=port, default=9002, help="Envoy's ext_proc service")
    parser.add_argument("--grpc-health-port", type=port, default=9003, help="the gRPC health service (grpc.health.v1)")
    parser.add_argument("--metrics-port", type=port, default=9090, help="Prometheus metrics, at /metrics")
    parser.add_argument("--host", default="0.0.0.0", help="address the three ports listen on")
    parser.add_argument(
        "--failure-mode",
        choices=[m.value for m in FailureMode],
        default=None,
        help="with no ready replica known: FailClose answers 503, FailOpen sends the request to an endpoint of the "
        "pool anyway (default: the InferencePool's spec.endpointPickerRef.failureMode, else FailClose)",
    )
    parser.add_argument(
        "--routing",
        choices=sorted(POLICIES),
        default=PrefixAffinityPolicy.name,
        help="as capstan gateway's: prefix (prompt hashing with bounded load), kv-events (the pod holding most of "
        "the prompt's KV pages, from the pods' KV events; else as prefix), round-robin",
    )
    parser.add_argument(
        "--kv-events-resync",
        type=float,
        default=DEFAULT_RESYNC_SECONDS,
        help="with --routing kv-events: seconds a pod whose events were lost is picked by prompt hashing",
    )
    parser.add_argument("--prefix-chars", type=int, default=DEFAULT_PREFIX_CHARS)
    parser.add_argument("--load-factor", type=float, default=DEFAULT_LOAD_FACTOR)
    parser.add_argument(
        "--poll-interval", type=float, default=1.0, help="seconds between reads of the pool and each replica"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger request bodies get 413"
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_SECONDS,
        help="seconds a request may take to arrive whole (headers to the body's end); slower ones get 408",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
