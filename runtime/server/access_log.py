"""uvicorn's access log without the probes' noise: a kubelet asks /health and /ready every few seconds and Prometheus
scrapes /metrics, so their successful answers are logged at DEBUG (shown with --log-level debug); a probe that fails
(503 while draining or when the engine died) stays at INFO, and so does every other request."""

from __future__ import annotations

import logging

PROBES = frozenset({"/health", "/ready", "/metrics"})


class ProbeAccessFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's: (client, method, path with query, HTTP version, status)
        if isinstance(args, tuple) and len(args) == 5 and args[4] == 200 and str(args[2]).split("?")[0] in PROBES:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_probes() -> None:
    """Installs the filter on uvicorn's access logger (once; call after uvicorn.Config set up its logging)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, ProbeAccessFilter) for f in access.filters):
        access.addFilter(ProbeAccessFilter())
