"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies), served only with
--allow-runtime-lora-updating (else 404, as vLLM answers)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from ..lora.request import LoRAError, check_name
from .context import ServerContext, get_context
from .error_body import APIError
from .json_body import StrictJSONRoute

router = APIRouter(route_class=StrictJSONRoute)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(max_length=256)
    lora_path: str = Field(max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(max_length=256)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, ctx: ServerContext = Depends(get_context)) -> str:
    name = body.lora_name
    try:
        check_name(name)
    except LoRAError as e:
        raise APIError(400, str(e), param="lora_name") from None
    if name in ctx.served_model_names or any(lora.lora_name == name for lora in ctx.engine.list_loras()):
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    if not body.lora_path:
        raise APIError(400, "lora_path: must not be empty", param="lora_path")
    ctx.check_ready()
    try:
        await ctx.engine.load_lora(name, body.lora_path)
    except LoRAError as e:
        raise APIError(400, str(e), param=e.field) from None
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, ctx: ServerContext = Depends(get_context)) -> str:
    ctx.check_ready()
    if not await ctx.engine.unload_lora(body.lora_name):
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
