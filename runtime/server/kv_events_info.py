"""GET /kv_events: where this server publishes its prefix cache's KV events (--kv-events-config), so a router finds
them from the replica's URL alone: one endpoint per engine core, the topic, the page size and the hash scheme a
subscriber needs to name a prompt's pages as the cache does. Open, like /version: it names ports, no data."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..kv.kv_events import endpoint_of_core
from ..kv.page_pool import HASH_SCHEME
from .context import ServerContext, get_context

router = APIRouter()


@router.get("/kv_events")
async def kv_events(ctx: ServerContext = Depends(get_context)) -> dict:
    config = ctx.engine.config
    events = config.kv_events_config
    if events is None or not events.publishes or not config.enable_prefix_caching:
        return {"enabled": False}
    cores = range(getattr(ctx.engine, "cores", 1))
    return {
        "enabled": True,
        "endpoints": [endpoint_of_core(events.endpoint, core) for core in cores],
        "replay_endpoints": None
        if events.replay_endpoint is None
        else [endpoint_of_core(events.replay_endpoint, core) for core in cores],
        "topic": events.topic,
        "block_size": config.page_size,
        "hash": HASH_SCHEME,
    }
