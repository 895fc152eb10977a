"""GET /version: the running Capstan version, as vLLM answers it ({"version": ...}); open, like the probes."""

from __future__ import annotations

from fastapi import APIRouter

import capstan

router = APIRouter()


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": capstan.__version__}
