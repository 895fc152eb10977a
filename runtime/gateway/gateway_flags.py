"""`capstan gateway`'s flags and their defaults, light to import: `capstan`'s parser is built at every command's
start (serve's too), and importing the gateway's HTTP stack for it cost ~1 s before serve could start its engine."""

from __future__ import annotations

import argparse

from ..arg_types import port
from ..server.tls import add_tls_flags
from .budgets import DEFAULT_WINDOW_SECONDS
from .kv_index import DEFAULT_RESYNC_SECONDS
from .routing_policy import DEFAULT_LOAD_FACTOR, DEFAULT_PREFIX_CHARS, POLICIES, PrefixAffinityPolicy

DEFAULT_PORT = 8080
DEFAULT_MAX_HELD = 256
DEFAULT_HOLD_TIMEOUT_SECONDS = 300.0  # a cold start: schedule a pod, load weights, compile


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
