"""OpenAI's Responses API request (POST /v1/responses) as pydantic models, and its conversation as the chat
request the server already serves: `instructions` a system message, input messages chat messages, function calls
and their outputs assistant tool calls and tool messages; `tools` in chat's shape.

Nothing is stored (vLLM's default without --enable-store): `previous_response_id`, `conversation` and `background`
are refused, naming the field, and a conversation goes whole in `input` (the SDK's `response.output` items can be
appended to it as they are). Fields bounded as the chat request's are (runtime/limits.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .. import limits
from ..sampling.grammar import StructuredOutput
from ..sampling.sampling_params import InvalidRequestError, SamplingParams
from ..sampling_keys import SamplingDefaults
from .json_values import Name, Text
from .protocol import ChatCompletionRequest, ChatMessage, ContentPart, FreeJSON, Probability, finite
from .structured import Schema
from .tools import (
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    NamedFunction,
    NamedToolChoice,
    Parameters,
    Tool,
    parse_arguments,
)
from .tools import ToolCall as ChatToolCall

TEXT_PARTS = ("input_text", "output_text", "text")  # a user's text, an earlier answer's text, chat's name
ITEM_TYPES = ("message", "function_call", "function_call_output")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class InputItem(_Request):
    """Any input item; which fields it needs depends on its type (checked in `as_chat_messages`, by index)."""

    type: Name | None = None  # left out: a message (the SDK's EasyInputMessage)
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Text | Annotated[list[ContentPart], Field(max_length=limits.MAX_CONTENT_PARTS)] | None = None
    call_id: Name | None = None
    name: FunctionName | None = None
    arguments: Annotated[Text, Field(max_length=limits.MAX_GRAMMAR_CHARS)] | None = None
    output: Text | Annotated[list[ContentPart], Field(max_length=limits.MAX_CONTENT_PARTS)] | None = None


class FunctionTool(_Request):
    """The Responses API's function tool: chat's `function` fields at the top level."""

    type: Name
    name: FunctionName | None = None
    description: Text | None = None
    parameters: Parameters | None = None
    strict: bool | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    description: Text | None = None
    json_schema: Schema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: Name | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=limits.MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=limits.INT32_MAX)] | None = None
    temperature: Annotated[float, finite(0.0, limits.MAX_TEMPERATURE)] | None = None
    top_p: Probability | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=limits.MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    metadata: (
        Annotated[
            dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]], Field(max_length=16)
        ]
        | None
    ) = None  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
    user: Name | None = None
    store: bool = True  # accepted; nothing is stored (module docstring)
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=limits.MAX_TOP_LOGPROBS)] | None = None
    previous_response_id: Name | None = None
    conversation: FreeJSON | None = None
    background: bool | None = None
    # vLLM's sampling extras, as on chat
    top_k: Annotated[int, Field(ge=-1, le=limits.INT32_MAX)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, finite(0.0, limits.MAX_REPETITION_PENALTY)] | None = None
    seed: Annotated[int, Field(ge=limits.INT64_MIN, le=limits.UINT64_MAX)] | None = None

    def refuse_unserved(self) -> None:
        """Fields whose meaning this server cannot give, refused by name rather than ignored."""
        unserved = {
            "previous_response_id": (self.previous_response_id is not None, "no responses are stored here"),
            "conversation": (self.conversation is not None, "no conversations are stored here"),
            "background": (bool(self.background), "responses are not run in the background here"),
            "truncation": (self.truncation == "auto", "the input is never cut here; leave it out or 'disabled'"),
            "top_logprobs": (bool(self.top_logprobs), "log probabilities are served on /v1/chat/completions"),
        }
        for field, (given, why) in unserved.items():
            if given:
                raise InvalidRequestError(
                    f"{field}: not supported ({why}); send the whole conversation in `input`"
                    if field in ("previous_response_id", "conversation")
                    else f"{field}: not supported ({why})",
                    field,
                )

    def chat_tools(self) -> list[Tool] | None:
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.type != "function":
                raise InvalidRequestError(
                    f"tools[{i}]: only function tools are served, not type {tool.type!r}", f"tools[{i}]"
                )
            if tool.name is None:
                raise InvalidRequestError(f"tools[{i}].name: a function tool needs its name", f"tools[{i}].name")
            function = FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            )
            tools.append(Tool(type="function", function=function))
        return tools

    def chat_messages(self) -> list[ChatMessage]:
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*messages, ChatMessage(role="user", content=self.input)]
        for i, item in enumerate(self.input):
            kind = item.type or "message"
            if kind not in ITEM_TYPES:
                raise InvalidRequestError(
                    f"input[{i}].type: items of type {kind!r} are not supported; send {', '.join(ITEM_TYPES)} items",
                    f"input[{i}].type",
                )
            if kind == "message":
                if item.role is None or item.content is None:
                    raise InvalidRequestError(f"input[{i}]: a message needs `role` and `content`", f"input[{i}]")
                messages.append(ChatMessage(role=item.role, content=_text(item.content, f"input[{i}].content")))
            elif kind == "function_call":
                if item.call_id is None or item.name is None or item.arguments is None:
                    raise InvalidRequestError(
                        f"input[{i}]: a function_call needs `call_id`, `name` and `arguments`", f"input[{i}]"
                    )
                parse_arguments(item.arguments, f"input[{i}].arguments")
                call = ChatToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":  # one assistant turn: its text and its calls
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                if item.call_id is None or item.output is None:
                    raise InvalidRequestError(
                        f"input[{i}]: a function_call_output needs `call_id` and `output`", f"input[{i}]"
                    )
                output = _text(item.output, f"input[{i}].output")
                messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        if not messages:
            raise InvalidRequestError("input: nothing to answer", "input")
        return messages

    def as_chat(self) -> ChatCompletionRequest:
        """The same conversation, tools and sampling as a chat request (validated already, so constructed)."""
        self.refuse_unserved()
        given, tools = self.tool_choice, self.chat_tools()
        if isinstance(given, FunctionChoice) and given.name not in {t.function.name for t in tools or ()}:
            raise InvalidRequestError(f"tool_choice.name: no tool named {given.name!r} in `tools`", "tool_choice.name")
        choice: Literal["none", "auto", "required"] | NamedToolChoice | None = (
            NamedToolChoice(type="function", function=NamedFunction(name=given.name))
            if isinstance(given, FunctionChoice)
            else given
        )
        return ChatCompletionRequest.model_construct(
            messages=self.chat_messages(),
            model=self.model,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            user=self.user,
            stream=self.stream,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
        )

    def sampling_params(
        self, chat: ChatCompletionRequest, max_logprobs: int, defaults: SamplingDefaults | None
    ) -> SamplingParams:
        params = chat.to_sampling_params(max_logprobs, defaults)
        structured = self.structured_output()
        if structured is not None:
            if params.structured is not None:
                raise InvalidRequestError(
                    "tool_choice: a required or named tool call cannot be combined with text.format", "tool_choice"
                )
            params.structured = structured
        return params

    def structured_output(self) -> StructuredOutput | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutput("json_object", param="text.format")
        if fmt.json_schema is None:
            raise InvalidRequestError("text.format.schema: required for type json_schema", "text.format.schema")
        return StructuredOutput("json", fmt.json_schema, "text.format.schema")

    def format_echo(self) -> dict[str, Any]:
        """`text` as the response reports it."""
        fmt = self.text.format if self.text and self.text.format else TextFormat(type="text")
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def _text(content: str | list[ContentPart], field: str) -> str:
    if isinstance(content, str):
        return content
    kinds = sorted({part.type for part in content} - set(TEXT_PARTS))
    if kinds:
        raise InvalidRequestError(f"{field}: parts of type {kinds} are not supported; send text parts only", field)
    return "".join(part.text or "" for part in content)
