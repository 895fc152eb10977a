"""Tool calling's response side: a choice's text as content and tool calls, whole or streamed as OpenAI streams
them (a call's id, type and name first, then deltas of function.arguments, then finish_reason "tool_calls").

Modes: `named` (the output is the named function's arguments), `required` (the output is a JSON array of
{"name", "parameters"}), `auto` (the model family's parser finds calls in free text; the stream holds back
only what may open a call), `none` (plain content)."""

from __future__ import annotations

import json
import uuid

from .protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCallOut, ToolCallOut
from .tool_parsers import ParsedCall


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallOutput:
    def __init__(self, mode: str, parser, named: str | None = None):
        self.mode, self.parser, self.named = mode, parser, named

    def split(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A finished choice's text as (content, calls); text that is not a well-formed call stays content."""
        if self.mode == "named":
            assert self.named is not None, "a named tool_choice names its function"
            return None, [ParsedCall(self.named, text)]
        if self.mode == "required":
            try:
                calls = [
                    ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)
                ]
            except (json.JSONDecodeError, TypeError, KeyError):
                return text, []  # cut short by max_tokens: what there is goes back as content
            return None, calls
        if self.mode == "auto":
            return self.parser.parse(text)
        return text, []

    def message_fields(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCallOut], str | None]:
        content, calls = self.split(text)
        out = [ToolCallOut(id=call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
        return content, out, ("tool_calls" if out and finish_reason == "stop" else finish_reason)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One choice's deltas: `feed` each piece of text, `finish` at the end; both return the DeltaMessages to send
    (possibly none) and the finish reason to report."""

    def __init__(self, output: ToolCallOutput):
        self.output = output
        self.held = ""  # text not sent yet: it may open a call
        self.text = ""  # all of the choice's text
        self.sent_content = False
        self.named_opened = False

    def feed(self, piece: str) -> list[DeltaMessage]:
        self.text += piece
        mode = self.output.mode
        if mode == "named":
            deltas = []
            if not self.named_opened:
                self.named_opened = True
                assert self.output.named is not None, "a named tool_choice names its function"
                deltas.append(self._call_delta(0, ParsedCall(self.output.named, "")))
            if piece:
                deltas.append(
                    DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece))])
                )
            return deltas
        if mode == "required":
            return []  # an array of calls: sent whole once it is complete
        if mode == "none":
            return [DeltaMessage(content=piece)] if piece else []
        self.held += piece
        if self._may_call():
            return []
        out, self.held = self.held, ""
        self.sent_content = True
        return [DeltaMessage(content=out)] if out else []

    def _may_call(self) -> bool:
        parser = self.output.parser
        if getattr(parser, "name", "") == "llama3_json" and self.sent_content:
            return False  # Llama 3 calls are the whole answer: once text went out as content, it stays content
        return parser.may_call(self.held)

    def finish(self, finish_reason: str | None) -> tuple[list[DeltaMessage], str | None]:
        mode = self.output.mode
        if mode == "named":
            deltas = [] if self.named_opened else self.feed("")
            return deltas, "tool_calls" if finish_reason == "stop" else finish_reason
        if mode == "none":
            return [], finish_reason
        if mode == "required":
            content, calls = self.output.split(self.text)
        else:
            content, calls = self.output.split(self.held) if self.held else (None, [])
        deltas = [DeltaMessage(content=content)] if content else []
        deltas += [self._call_delta(i, call, with_arguments=True) for i, call in enumerate(calls)]
        return deltas, ("tool_calls" if calls and finish_reason == "stop" else finish_reason)

    @staticmethod
    def _call_delta(index: int, call: ParsedCall, with_arguments: bool = False) -> DeltaMessage:
        function = DeltaFunctionCall(name=call.name, arguments=call.arguments if with_arguments else "")
        return DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call_id(), type="function", function=function)])
