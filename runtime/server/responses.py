"""POST /v1/responses: OpenAI's Responses API over the chat machinery (responses_protocol.py turns the request into
a chat turn). The answer is a `response` whose output holds the assistant's message and its function calls; a
stream is the API's typed events (response.created ... response.output_text.delta ... response.completed), each
with its sequence_number, and no [DONE]."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from .chat import prepare_turn
from .context import ServerContext, get_context
from .generation import Generation, respond, sse
from .json_body import StrictJSONRoute
from .responses_protocol import FunctionChoice, ResponsesRequest
from .tool_calls import ToolCallOutput, call_id
from .tool_parsers import ParsedCall

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, ctx: ServerContext = Depends(get_context)):
    chat = body.as_chat()
    model = ctx.resolve_model(body.model)
    params = body.sampling_params(chat, ctx.engine.config.max_logprobs, ctx.sampling_defaults)
    prompt, tools = prepare_turn(chat, params, ctx)
    gen = Generation(ctx, f"resp_{uuid.uuid4().hex}", "chat", model, [prompt], params)
    answer = Answer(gen, body, int(time.time()))
    return await respond(request, gen, body.stream, lambda g: answer.events(tools), lambda g: answer.whole(tools))


class Answer:
    """One response's envelope and output items, whole or as stream events."""

    def __init__(self, gen: Generation, body: ResponsesRequest, created_at: int):
        self.gen, self.body, self.created_at = gen, body, created_at
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._seq = itertools.count()

    def whole(self, tools: ToolCallOutput) -> dict[str, Any]:
        choice = self.gen.choices[0][0]
        content, calls = tools.split(choice.text)
        status = self._status(choice.finish_reason)
        output = [*self._message(content, status, calls), *(_function_call(call) for call in calls)]
        return self._envelope(status, output, usage=True)

    async def events(self, tools: ToolCallOutput) -> AsyncIterator[str]:
        head = self._envelope("in_progress", [], usage=False)
        yield self._event("response.created", response=head)
        yield self._event("response.in_progress", response=head)
        stream, text, opened = tools.stream(), "", False
        calls: dict[int, dict[str, str]] = {}  # by the call's index: name and arguments so far
        async for _, out in self.gen.deltas():
            for c in out.outputs:
                deltas = stream.feed(c.text) if c.text else []
                if c.finish_reason is not None:
                    deltas += stream.finish(c.finish_reason)[0]
                for delta in deltas:
                    if delta.content:
                        if not opened:
                            opened = True
                            for event in self._open_message():
                                yield event
                        text += delta.content
                        yield self._event("response.output_text.delta", **self._at_text(), delta=delta.content)
                    for tc in delta.tool_calls or ():
                        call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                        call["name"] += tc.function.name or ""
                        call["arguments"] += tc.function.arguments or ""
        status = self._status(self.gen.choices[0][0].finish_reason)
        parsed = [ParsedCall(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        output = list(self._message(text, status, parsed))
        if output:
            if not opened:
                for event in self._open_message():
                    yield event
            part = output[0]["content"][0]
            yield self._event("response.output_text.done", **self._at_text(), text=text)
            yield self._event("response.content_part.done", **self._at_text(logprobs=False), part=part)
            yield self._event("response.output_item.done", output_index=0, item=output[0])
        for parsed_call in parsed:
            item, index = _function_call(parsed_call), len(output)
            output.append(item)
            yield self._event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            at = {"item_id": item["id"], "output_index": index}
            arguments = parsed_call.arguments
            yield self._event("response.function_call_arguments.delta", **at, delta=arguments)
            yield self._event("response.function_call_arguments.done", **at, name=parsed_call.name, arguments=arguments)
            yield self._event("response.output_item.done", output_index=index, item=item)
        final = self._envelope(status, output, usage=True)
        yield self._event("response.incomplete" if status == "incomplete" else "response.completed", response=final)

    def _open_message(self) -> Iterator[str]:
        item = {"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant", "content": []}
        yield self._event("response.output_item.added", output_index=0, item=item)
        yield self._event("response.content_part.added", **self._at_text(logprobs=False), part=_output_text(""))

    def _at_text(self, logprobs: bool = True) -> dict[str, Any]:
        at: dict[str, Any] = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return {**at, "logprobs": []} if logprobs else at

    def _message(self, content: str | None, status: str, calls: list[ParsedCall]) -> Iterator[dict[str, Any]]:
        """The assistant's message: its text, or none when the answer is only function calls."""
        if content or not calls:
            yield {
                "type": "message",
                "id": self.message_id,
                "status": status,
                "role": "assistant",
                "content": [_output_text(content or "")],
            }

    def _status(self, finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def _event(self, kind: str, **fields: Any) -> str:
        return sse(json.dumps({"type": kind, "sequence_number": next(self._seq), **fields}, ensure_ascii=False), kind)

    def _envelope(self, status: str, output: list[dict[str, Any]], usage: bool) -> dict[str, Any]:
        body, params = self.body, self.gen.params
        choice = body.tool_choice
        return {
            "id": self.gen.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.gen.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,  # nothing is kept (responses_protocol.py)
            "temperature": params.temperature,
            "text": body.format_echo(),
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": self._usage() if usage else None,
            "user": body.user,
        }

    def _usage(self) -> dict[str, Any]:
        u = self.gen.usage()
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        config = self.gen.ctx.engine.config
        # the prefix cache keeps the prompt's full pages: those this request computed are now cached
        written = max(u.prompt_tokens // config.page_size * config.page_size - cached, 0)
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": written if config.enable_prefix_caching else 0,
            },
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens,
        }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call: ParsedCall) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id(),
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }
