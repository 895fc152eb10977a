"""Generation: one API request's engine requests (one per prompt) as a single stream of deltas, with the
latency metrics, the span, the request log line, and abort-on-close that frees KV pages at once."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..engine.outputs import RequestOutput
from ..sampling.sampling_params import SamplingParams
from .context import ServerContext
from .errors import exception_body
from .metrics import RequestTimer
from .protocol import PromptTokensDetails, Usage
from .tracing import end_request_span, start_request_span

log = logging.getLogger("capstan.server")

CLIENT_CLOSED = 499  # nginx's code for "client closed the request": nobody reads this response


@dataclasses.dataclass
class Choice:
    """A choice accumulated from its deltas (non-streaming responses and usage)."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


class Generation:
    def __init__(
        self,
        ctx: ServerContext,
        request_id: str,
        operation: str,
        model: str,
        prompts: list[str | list[int]],
        params: SamplingParams,
    ):
        """model: as resolved (ServerContext.resolve_model): a LoRA adapter's name runs its prompts with it."""
        self.ctx, self.id, self.operation, self.model = ctx, request_id, operation, model
        self.lora_name = ctx.adapter(model)
        self.prompts, self.params = prompts, params
        self.arrival = time.perf_counter()
        self.prompt_token_ids: list[list[int]] = [[] for _ in prompts]
        self.prompt_logprobs: list[list | None] = [None for _ in prompts]
        self.cached_tokens = [0 for _ in prompts]
        self.choices = [[Choice() for _ in range(params.n)] for _ in prompts]
        self._finished = [False for _ in prompts]
        self._timers = [RequestTimer(ctx.metrics, self.arrival) for _ in prompts]
        self._gens: list[AsyncIterator[RequestOutput]] = []
        self._firsts: list[RequestOutput] = []
        self._span = None
        self._closed = False

    def engine_id(self, i: int) -> str:
        return f"{self.id}-{i}"

    async def start(self) -> None:
        """Submits every prompt and waits for each one's first output, so a refused request (400, 429) fails
        before any response header is sent."""
        engine = self.ctx.engine
        if self.ctx.log_prompts:
            log.info("request %s prompts: %r", self.id, self.prompts)
        self._span = start_request_span(self.ctx.tracer, self.operation, self.model, self.params)
        self._gens = [
            engine.generate(p, self.params, self.engine_id(i), self.lora_name) for i, p in enumerate(self.prompts)
        ]
        try:
            firsts = await asyncio.gather(*(anext(g) for g in self._gens), return_exceptions=True)
        except BaseException as e:
            self.close(e)
            raise
        for i, first in enumerate(firsts):
            if isinstance(first, BaseException):
                self._finished[i] = True  # its engine request never started or already ended
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            self.close(errors[0])
            raise errors[0]
        self._firsts = [f for f in firsts if not isinstance(f, BaseException)]  # all of them: none failed
        log.info(
            "request %s: %s, %d prompt(s), %d prompt tokens, n=%d, max_tokens=%s",
            self.id,
            self.operation,
            len(self.prompts),
            sum(len(f.prompt_token_ids) for f in firsts if isinstance(f, RequestOutput)),
            self.params.n,
            self.params.max_tokens,
        )

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) pairs from all prompts, as they arrive."""
        pending = []
        for i, first in enumerate(self._firsts):
            self._account(i, first)
            yield i, first
            if not first.finished:
                pending.append(i)
        if len(pending) == 1:
            i = pending[0]
            async for out in self._gens[i]:
                self._account(i, out)
                yield i, out
        elif pending:
            async for i, out in _merge({i: self._gens[i] for i in pending}):
                self._account(i, out)
                yield i, out

    async def run_to_end(self) -> None:
        async for _ in self.deltas():
            pass

    def _account(self, i: int, out: RequestOutput) -> None:
        self._timers[i].observe(out)
        if out.prompt_token_ids:
            self.prompt_token_ids[i] = out.prompt_token_ids
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[i] = out.prompt_logprobs
        self.cached_tokens[i] = max(self.cached_tokens[i], out.num_cached_tokens)
        for c in out.outputs:
            choice = self.choices[i][c.index]
            choice.text += c.text
            choice.token_ids += c.token_ids
            if c.logprobs:
                choice.logprobs += c.logprobs
            if c.finish_reason is not None:
                choice.finish_reason = c.finish_reason
        if out.finished:
            self._finished[i] = True

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for per_prompt in self.choices for c in per_prompt)

    def usage(self) -> Usage:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens)),
        )

    def close(self, error: BaseException | None = None) -> None:
        """Ends the request: aborts what is still running (freeing its pages), records metrics, ends the span."""
        if self._closed:
            return
        self._closed = True
        for i, finished in enumerate(self._finished):
            if not finished:
                self.ctx.engine.abort(self.engine_id(i))
                self._timers[i].aborted(sum(c.finish_reason is None for c in self.choices[i]))
        reasons = [c.finish_reason or "abort" for per_prompt in self.choices for c in per_prompt]
        end_request_span(
            self._span,
            response_id=self.id,
            model=self.model,
            input_tokens=self.prompt_tokens,
            output_tokens=self.completion_tokens,
            finish_reasons=reasons,
            error=error,
        )
        if self._firsts:
            log.info(
                "request %s finished: %d completion tokens, finish_reason=%s, %.2f s",
                self.id,
                self.completion_tokens,
                ",".join(sorted(set(reasons))),
                time.perf_counter() - self.arrival,
            )


async def respond(request: Request, gen: Generation, stream: bool, events, build):
    """Starts `gen`, then streams `events(gen)` as SSE or returns `build(gen)` once it finished; a client
    that disconnects at any point aborts it."""
    started, _ = await until_disconnected(request, gen.start())
    if not started:
        gen.close()
        return Response(status_code=CLIENT_CLOSED)
    if stream:
        return SSEResponse(_guarded(events(gen), gen.id), on_close=gen.close)
    try:
        finished, _ = await until_disconnected(request, gen.run_to_end())
    finally:
        gen.close()
    return build(gen) if finished else Response(status_code=CLIENT_CLOSED)


async def _guarded(events: AsyncIterator[str], request_id: str) -> AsyncIterator[str]:
    """Headers are sent by now, so a failure mid-stream becomes an error event (as vLLM sends) and [DONE]."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - logged with its trace; the client sees OpenAI's error body
        log.exception("request %s failed mid-stream", request_id)
        yield sse(json.dumps(exception_body(e)[1]))
        yield SSE_DONE


async def _merge(gens: dict[int, AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several engine streams; cancelling the consumer cancels every pump (and so aborts)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in gens.items()]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnected(request: Request, work):
    """Runs `work` (a coroutine) unless the client disconnects first, in which case it is cancelled.
    Returns (True, result) when it finished, (False, None) when the client went away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return False, None
    return True, task.result()


class SSEResponse(StreamingResponse):
    """Server-sent events whose `on_close` runs however the stream ends: finished, failed or disconnected."""

    def __init__(self, events: AsyncIterator[str], on_close):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(data: str, event: str | None = None) -> str:
    """One server-sent event; `event` names its type (the Responses API's streams name every event)."""
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
