"""GET /v1/models: the names this server answers to, with the context length it serves, then its LoRA adapters
(vLLM's cards: `root` the adapter's path, `parent` the base model's name)."""

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
    cards += [
        ModelCard(
            id=lora.lora_name,
            created=ctx.created,
            root=lora.lora_path,
            parent=ctx.model_name,
            max_model_len=engine.config.max_model_len,
        )
        for lora in engine.list_loras()
        if lora.lora_name not in ctx.served_model_names
    ]
    return ModelList(data=cards)
