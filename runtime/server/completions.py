"""POST /v1/completions: OpenAI's legacy completions (prompt as text, texts, token ids or lists of them)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request

from .context import ServerContext, get_context
from .generation import SSE_DONE, Choice, Generation, respond, sse
from .json_body import StrictJSONRoute
from .protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request, ctx: ServerContext = Depends(get_context)):
    model = ctx.resolve_model(body.model)
    params = body.to_sampling_params(ctx.engine.config.max_logprobs, ctx.sampling_defaults)
    prompts = body.prompts()
    ctx.validate(params, len(prompts))  # every limit, before anything is built per prompt or per choice
    ctx.check_ready()
    gen = Generation(ctx, f"cmpl-{uuid.uuid4().hex}", "text_completion", model, prompts, params)
    return await respond(request, gen, body.stream, lambda g: _events(g, body, ctx), lambda g: _response(g, body, ctx))


def _prompt_text(gen: Generation, i: int, ctx: ServerContext) -> str:
    prompt = gen.prompts[i]
    return prompt if isinstance(prompt, str) else ctx.engine.tokenizer.decode(prompt, skip_special_tokens=False)


class _LogprobWriter:
    """OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset) for one choice;
    offsets continue across stream chunks."""

    def __init__(self, tokenizer, offset: int = 0):
        self._tokenizer, self.offset = tokenizer, offset

    def write(self, token_ids: list[int], positions: list) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, position in zip(token_ids, positions, strict=True):
            if position is None:  # the first prompt token has no logprob
                token, logprob, top = self._tokenizer.decode([token_id], skip_special_tokens=False), None, None
            else:
                chosen = position[token_id]
                token, logprob = chosen.decoded_token, chosen.logprob
                top = {lp.decoded_token: lp.logprob for lp in position.values()}
            out.tokens.append(token)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(token)
        return out


def _join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )


def _response(gen: Generation, body: CompletionRequest, ctx: ServerContext) -> CompletionResponse:
    choices: list[CompletionChoice] = []
    for i, per_prompt in enumerate(gen.choices):
        for choice in per_prompt:
            choices.append(_choice(gen, body, ctx, i, len(choices), choice))
    return CompletionResponse(id=gen.id, model=gen.model, choices=choices, usage=gen.usage())


def _choice(
    gen: Generation, body: CompletionRequest, ctx: ServerContext, i: int, index: int, choice: Choice
) -> CompletionChoice:
    text, logprobs = choice.text, None
    writer = _LogprobWriter(ctx.engine.tokenizer)
    prompt_logprobs = CompletionLogprobs()
    if body.echo:
        prompt_text = _prompt_text(gen, i, ctx)
        text = prompt_text + text
        prompt_positions = gen.prompt_logprobs[i]
        if body.logprobs is not None and prompt_positions is not None:
            prompt_logprobs = writer.write(gen.prompt_token_ids[i], prompt_positions)
        writer.offset = len(prompt_text)
    if body.logprobs is not None:
        assert choice.logprobs is not None, "asked for (SamplingParams.logprobs), so computed"
        logprobs = _join(prompt_logprobs, writer.write(choice.token_ids, choice.logprobs))
    return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason)


async def _events(gen: Generation, body: CompletionRequest, ctx: ServerContext):
    n = gen.params.n
    writers: dict[int, _LogprobWriter] = {}
    created = CompletionResponse(id=gen.id, model=gen.model, choices=[]).created
    exclude = None if body.stream_options and body.stream_options.include_usage else {"usage"}
    async for i, out in gen.deltas():
        choices = []
        for c in out.outputs:
            index = i * n + c.index
            text, logprobs = c.text, None
            if index not in writers:  # this choice's first chunk: the echoed prompt goes first
                writers[index] = _LogprobWriter(ctx.engine.tokenizer)
                if body.echo:
                    prompt_text = _prompt_text(gen, i, ctx)
                    text = prompt_text + text
                    if body.logprobs is not None and out.prompt_logprobs is not None:
                        logprobs = writers[index].write(out.prompt_token_ids, out.prompt_logprobs)
                    writers[index].offset = len(prompt_text)
            if body.logprobs is not None and c.token_ids:
                generated = writers[index].write(c.token_ids, c.logprobs or [])
                logprobs = _join(logprobs, generated) if logprobs else generated
            if text or logprobs or c.finish_reason:
                choices.append(
                    CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason)
                )
        if choices:
            chunk = CompletionResponse(id=gen.id, created=created, model=gen.model, choices=choices)
            yield sse(chunk.model_dump_json(exclude=exclude))
    if exclude is None:
        chunk = CompletionResponse(id=gen.id, created=created, model=gen.model, choices=[], usage=gen.usage())
        yield sse(chunk.model_dump_json())
    yield SSE_DONE
