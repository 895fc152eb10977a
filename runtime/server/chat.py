"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, generation stopped
at its end-of-turn token."""

from __future__ import annotations

import uuid

import jinja2
from fastapi import APIRouter, Depends, Request

from ..sampling.sampling_params import InvalidRequestError
from .context import ServerContext, get_context
from .generation import SSE_DONE, Generation, respond, sse
from .json_body import StrictJSONRoute
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    NamedToolChoice,
    TokenLogprob,
    TopLogprob,
)
from .tool_calls import ToolCallOutput
from .tools import template_tools

router = APIRouter(route_class=StrictJSONRoute)


def render_prompt(body: ChatCompletionRequest, tokenizer, engine) -> list[int]:
    messages = [m.as_template_message(i) for i, m in enumerate(body.messages)]
    engine.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            **{**(body.chat_template_kwargs or {}), "tools": template_tools(body.tools)},
        )
    except (jinja2.TemplateError, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise InvalidRequestError(f"messages: the model's chat template refused them: {e}", "messages") from e
    engine.check_prompt_chars(len(text), "messages")
    return tokenizer.encode(text, add_special_tokens=False)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: ServerContext = Depends(get_context)
):
    model = ctx.resolve_model(body.model)
    params = body.to_sampling_params(ctx.engine.config.max_logprobs, ctx.sampling_defaults)
    prompt, tools = prepare_turn(body, params, ctx)
    gen = Generation(ctx, f"chatcmpl-{uuid.uuid4().hex}", "chat", model, [prompt], params)
    return await respond(
        request, gen, body.stream, lambda g: _events(g, body, tools), lambda g: _response(g, body, tools)
    )


def prepare_turn(body: ChatCompletionRequest, params, ctx: ServerContext) -> tuple[list[int], ToolCallOutput]:
    """The assistant turn's prompt (the template's), stopping at its end of turn, and how its answer's tool calls
    are read; every limit checked before anything is built per choice (also for /v1/responses)."""
    ctx.validate(params, 1)
    tokenizer = ctx.engine.tokenizer
    if not params.ignore_eos:
        params.stop_token_ids = sorted(set(params.stop_token_ids or []) | set(tokenizer.end_of_turn_ids()))
    prompt = render_prompt(body, tokenizer, ctx.engine)
    ctx.check_ready()
    choice = body.tool_choice
    named = choice.function.name if body.tool_mode == "named" and isinstance(choice, NamedToolChoice) else None
    return prompt, ToolCallOutput(body.tool_mode, ctx.tool_parser, named)


def _logprobs(token_ids: list[int], positions: list, top_n: int) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = position[token_id]
        top = sorted((lp for lp in position.values() if lp.rank <= top_n), key=lambda lp: lp.rank)
        content.append(
            TokenLogprob(
                token=chosen.decoded_token,
                logprob=chosen.logprob,
                bytes=list(chosen.decoded_token.encode()),
                top_logprobs=[
                    TopLogprob(token=lp.decoded_token, logprob=lp.logprob, bytes=list(lp.decoded_token.encode()))
                    for lp in top
                ],
            )
        )
    return ChatLogprobs(content=content)


def _response(gen: Generation, body: ChatCompletionRequest, tools: ToolCallOutput) -> ChatCompletionResponse:
    choices = []
    for c_index, choice in enumerate(gen.choices[0]):
        content, calls, finish_reason = tools.message_fields(choice.text, choice.finish_reason)
        choices.append(
            ChatChoice(
                index=c_index,
                message=AssistantMessage(content=content, tool_calls=calls),
                finish_reason=finish_reason,
                logprobs=_logprobs(choice.token_ids, choice.logprobs, body.top_logprobs or 0)
                if body.logprobs
                else None,
            )
        )
    return ChatCompletionResponse(id=gen.id, model=gen.model, choices=choices, usage=gen.usage())


async def _events(gen: Generation, body: ChatCompletionRequest, tools: ToolCallOutput):
    created = ChatCompletionResponse(id=gen.id, model=gen.model, choices=[]).created
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}

    def chunk(choices: list[ChatChunkChoice]) -> str:
        c = ChatCompletionChunk(id=gen.id, created=created, model=gen.model, choices=choices)
        return sse(c.model_dump_json(exclude=exclude))

    # OpenAI opens every choice with the role and empty content.
    yield chunk(
        [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(gen.params.n)]
    )
    streams = [tools.stream() for _ in range(gen.params.n)]
    async for _, out in gen.deltas():
        choices, finished = [], []
        for c in out.outputs:
            logprobs = None
            if body.logprobs and c.token_ids:
                logprobs = _logprobs(c.token_ids, c.logprobs or [], body.top_logprobs or 0)
            deltas = streams[c.index].feed(c.text) if c.text else []
            if c.finish_reason is not None:
                more, finish_reason = streams[c.index].finish(c.finish_reason)
                deltas += more
                finished.append(ChatChunkChoice(index=c.index, delta=DeltaMessage(), finish_reason=finish_reason))
            if logprobs and not deltas:
                deltas = [DeltaMessage()]
            for k, delta in enumerate(deltas):  # logprobs ride on the last delta
                choices.append(
                    ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs if k == len(deltas) - 1 else None)
                )
        if choices:
            yield chunk(choices)
        if finished:  # as OpenAI sends it: the finish reason in a chunk of its own, with an empty delta
            yield chunk(finished)
    if include_usage:
        usage = ChatCompletionChunk(id=gen.id, created=created, model=gen.model, choices=[], usage=gen.usage())
        yield sse(usage.model_dump_json())
    yield SSE_DONE
