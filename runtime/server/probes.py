"""Probes and scrapes, open without an API key: /health (liveness), /ready (readiness), /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from .context import ServerContext, get_context
from .error_body import error_response
from .metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(ctx: ServerContext = Depends(get_context)):
    """Alive while the engine loop runs; a dead loop never recovers, so the kubelet should restart the pod."""
    if not ctx.engine.is_alive():
        return error_response(503, "the engine loop has stopped", code="engine_dead")
    return {"status": "ok"}


@router.get("/ready")
async def ready(ctx: ServerContext = Depends(get_context)):
    """Ready once weights are loaded and the programs a first request needs are compiled (the others compile while
    serving), until draining starts."""
    if ctx.drain.draining:
        return error_response(503, "draining: the server is shutting down", code="draining")
    if not ctx.engine.is_ready():
        return error_response(503, "loading weights or compiling (warm-up)", code="not_ready")
    if not ctx.engine.is_alive():
        return error_response(503, "the engine loop has stopped", code="engine_dead")
    return {"status": "ready"}


@router.get("/metrics")
async def metrics(ctx: ServerContext = Depends(get_context)) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
