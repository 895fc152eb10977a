"""POST /tokenize, /detokenize and GET /tokenizer_info in vLLM's shapes: a prompt (or chat messages, rendered
exactly as /v1/chat/completions renders them) to token ids, ids back to text, and the tokenizer's special tokens and
chat template (what lm-eval's `remote` tokenizer reads, so clients score with the served tokenizer and download none).
Request and response models live here."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from .. import limits
from ..sampling.sampling_params import InvalidRequestError
from .chat import render_prompt
from .context import ServerContext, get_context
from .json_body import StrictJSONRoute
from .protocol import ChatCompletionRequest, ChatMessage, FreeJSON, Name, Text, TokenId

router = APIRouter(route_class=StrictJSONRoute)


class TokenizeRequest(BaseModel):
    """vLLM's two forms in one model: `prompt` (completion) or `messages` (chat), exactly one of them."""

    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=limits.MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Annotated[dict[Name, FreeJSON], Field(max_length=limits.MAX_TEMPLATE_KWARGS)] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=limits.MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    tokenizer_class: str = (
        "PreTrainedTokenizerFast"  # transformers' name for a `tokenizers` backend, as vLLM reports it
    )
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int


@router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize(body: TokenizeRequest, ctx: ServerContext = Depends(get_context)) -> TokenizeResponse:
    ctx.resolve_model(body.model)
    engine, tokenizer = ctx.engine, ctx.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("prompt: send exactly one of prompt (text) or messages (chat)", "prompt")
    if body.prompt is not None:
        engine.check_prompt_chars(len(body.prompt), "prompt")
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        if body.continue_final_message:
            raise InvalidRequestError("continue_final_message: not supported by this server", "continue_final_message")
        if body.add_special_tokens:
            raise InvalidRequestError(
                "add_special_tokens: with messages the chat template writes the special tokens; send false or omit it",
                "add_special_tokens",
            )
        chat = ChatCompletionRequest(
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        ids = render_prompt(chat, tokenizer, engine)  # the ids /v1/chat/completions would run
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.config.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, ctx: ServerContext = Depends(get_context)) -> DetokenizeResponse:
    ctx.resolve_model(body.model)
    vocab = ctx.engine.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=ctx.engine.tokenizer.decode(body.tokens, skip_special_tokens=False))


@router.get("/tokenizer_info", response_model=TokenizerInfoResponse)
async def tokenizer_info(ctx: ServerContext = Depends(get_context)) -> TokenizerInfoResponse:
    tokenizer = ctx.engine.tokenizer
    return TokenizerInfoResponse(
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        unk_token=tokenizer.unk_token,
        chat_template=tokenizer.chat_template,
        model_max_length=ctx.engine.config.max_model_len,
    )
