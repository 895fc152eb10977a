"""POST /v1/embeddings: unit-length embeddings of decoder checkpoints, pooled from the final hidden states (last
token or mean, `--embedding-pooling`), as floats or base64 float32; request and response models live here.

The inputs run through the engine (runtime/engine/embedder.py) between generation steps, on its KV pages."""

from __future__ import annotations

import base64
import logging
import time
import uuid
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from .. import limits
from ..sampling.sampling_params import InvalidRequestError
from .context import ServerContext, get_context
from .generation import CLIENT_CLOSED, until_disconnected
from .json_body import StrictJSONRoute
from .protocol import Name, Text, TokenList, is_token_list

log = logging.getLogger("capstan.server")
router = APIRouter(route_class=StrictJSONRoute)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=limits.MAX_EMBEDDING_INPUTS)]
        | TokenList
        | Annotated[list[TokenList], Field(min_length=1, max_length=limits.MAX_EMBEDDING_INPUTS)]
    )
    model: Name | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=limits.INT32_MAX)] | None = None
    user: Name | None = None

    def inputs(self) -> list[str | list[int]]:
        """One embedding per string or per token list, in order."""
        if isinstance(self.input, str):
            return [self.input]
        texts_or_tokens = self.input
        if is_token_list(texts_or_tokens):
            return [list(texts_or_tokens)]
        return list(texts_or_tokens)


class Embedding(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embedding(body: EmbeddingRequest, request: Request, ctx: ServerContext = Depends(get_context)):
    model = ctx.resolve_model(body.model)
    if ctx.adapter(model) is not None:
        raise InvalidRequestError(
            f"model: {model} is a LoRA adapter; embeddings come from the base model ({ctx.model_name})", "model"
        )
    size = ctx.engine.embedding_dimensions
    if body.dimensions is not None and body.dimensions != size:
        raise InvalidRequestError(
            f"dimensions: this model's embeddings have {size} dimensions and cannot be shortened "
            f"(it is not a Matryoshka model); omit dimensions or send {size}",
            "dimensions",
        )
    inputs = body.inputs()
    cap = ctx.engine.config.max_waiting
    if len(inputs) > cap:
        raise InvalidRequestError(
            f"input: {len(inputs)} inputs, more than the server queues ({cap}, --max-waiting)", "input"
        )
    ctx.check_ready()
    request_id, started = f"embd-{uuid.uuid4().hex}", time.perf_counter()
    finished, outputs = await until_disconnected(request, ctx.engine.embed(inputs, request_id))
    if not finished:
        return Response(status_code=CLIENT_CLOSED)
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    log.info(
        "request %s: embeddings, %d input(s), %d tokens, %.2f s",
        request_id,
        len(inputs),
        tokens,
        time.perf_counter() - started,
    )
    data = [
        Embedding(index=i, embedding=_encode(o.outputs.embedding, body.encoding_format)) for i, o in enumerate(outputs)
    ]
    return EmbeddingResponse(
        id=request_id, model=model, data=data, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")  # OpenAI's layout
