"""GET /v1/models: the names this server answers to, with the context length it serves."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from .context import ServerContext, get_context
from .protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(ctx: ServerContext = Depends(get_context)) -> ModelList:
    engine = ctx.engine
    cards = [
        ModelCard(id=name, created=ctx.created, root=engine.model_name, max_model_len=engine.config.max_model_len)
        for name in ctx.served_model_names
    ]
    return ModelList(data=cards)
