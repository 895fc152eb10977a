"""OpenAI's request and response bodies as pydantic models, with vLLM's extra sampling fields.

Unknown fields are ignored (SDKs send fields we do not use); fields we know are type-checked and bounded here
with the limits of runtime/limits.py (pydantic refuses a value out of bounds, naming the field and the limit),
and what depends on the served model or the server's flags is refused in `to_sampling_params` or by
`SamplingParams.validate`, still before anything is built per choice or per token.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer

from .. import limits
from ..sampling.sampling_params import InvalidRequestError, SamplingParams
from ..sampling_keys import SamplingDefaults
from .json_values import Name, Text, bounded_json
from .structured import StructuredFields
from .tools import NamedToolChoice, Tool, ToolCall, ToolChoice, forced_tool_output, template_tool_calls

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13

Count = Annotated[int, Field(ge=0, le=limits.INT32_MAX)]
FreeJSON = Annotated[Any, AfterValidator(bounded_json)]  # free-form objects: depth and text checked


def finite(low: float, high: float) -> Any:
    """Annotated[float, finite(low, high)]: a float in [low, high]; NaN and infinities are refused by name."""
    return Field(ge=low, le=high, allow_inf_nan=False)


Probability = Annotated[float, finite(0.0, 1.0)]
Penalty = Annotated[float, finite(-limits.PENALTY_RANGE, limits.PENALTY_RANGE)]
TokenId = Annotated[int, Field(ge=0, le=limits.INT32_MAX)]
StopString = Annotated[Text, Field(min_length=1, max_length=limits.MAX_STOP_STRING_CHARS)]
# request fields that fall back to the model's generation config when left out (sampling_keys.SAMPLING_KEYS)
DEFAULTED_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
)
DryBreaker = Annotated[Text, Field(min_length=1, max_length=limits.MAX_DRY_BREAKER_CHARS)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(StructuredFields):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras (structured outputs: structured.py)."""

    model: Name | None = None
    n: Annotated[int, Field(ge=1, le=limits.INT32_MAX)] = 1
    temperature: Annotated[float, finite(0.0, limits.MAX_TEMPERATURE)] | None = None
    top_p: Probability | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=limits.MAX_STOP_STRINGS)] | None = None
    seed: Annotated[int, Field(ge=limits.INT64_MIN, le=limits.UINT64_MAX)] | None = None
    presence_penalty: Penalty | None = None  # None: the model's default (the default model's frequency penalty)
    frequency_penalty: Penalty | None = None
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=16)],
                Annotated[float, finite(-limits.LOGIT_BIAS_RANGE, limits.LOGIT_BIAS_RANGE)],
            ],
            Field(max_length=limits.MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    user: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=limits.INT32_MAX)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, finite(0.0, limits.MAX_REPETITION_PENALTY)] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=limits.MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    # llama-server's DRY fields (sampling/dry.py)
    dry_multiplier: Annotated[float, finite(0.0, limits.MAX_DRY_MULTIPLIER)] | None = None
    dry_base: Annotated[float, finite(1.0, limits.MAX_DRY_BASE)] | None = None
    dry_allowed_length: Annotated[int, Field(ge=0, le=limits.DRY_MAX_MATCH)] | None = None
    dry_penalty_last_n: Annotated[int, Field(ge=-1, le=limits.INT32_MAX)] | None = None
    dry_sequence_breakers: Annotated[list[DryBreaker], Field(max_length=limits.MAX_DRY_BREAKERS)] | None = None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed when stream is true", "stream_options")

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: SamplingDefaults | None = None,
    ):
        """defaults: what a field the request leaves out takes (the model's generation config and the server's
        override, generation_config.py), before SamplingParams' own."""
        bias = None
        if self.logit_bias:
            try:
                bias = {int(token): value for token, value in self.logit_bias.items()}
            except ValueError as e:
                raise InvalidRequestError(
                    "logit_bias: keys must be token ids (integers as strings)", "logit_bias"
                ) from e
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        # request > --override-generation-config > the model's generation config > SamplingParams' own defaults
        sampling: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k in DEFAULTED_FIELDS}
        sampling |= {name: getattr(self, name) for name in DEFAULTED_FIELDS if getattr(self, name) is not None}
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logit_bias=bias,
            seed=self.seed,
            stop=stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured=self.structured_output(),
            **sampling,
        )


# --- /v1/completions ---

TokenList = Annotated[list[TokenId], Field(min_length=1)]


def is_token_list(texts_or_tokens: list[str] | list[int] | list[list[int]]) -> TypeIs[list[int]]:
    """Whether a list of prompts or inputs is one token list (else strings, or several token lists)."""
    return all(isinstance(t, int) for t in texts_or_tokens)


class CompletionRequest(_SamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=limits.MAX_PROMPTS)]
        | TokenList
        | Annotated[list[TokenList], Field(min_length=1, max_length=limits.MAX_PROMPTS)]
    )
    max_tokens: Annotated[int, Field(ge=0, le=limits.INT32_MAX)] | None = 16  # 0 only with echo (scoring)
    logprobs: Annotated[int, Field(ge=0, le=limits.MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: Annotated[int, Field(ge=1, le=limits.INT32_MAX)] | None = None

    def prompts(self) -> list[str | list[int]]:
        """One engine request per prompt: a string, a list of strings, one token list or several."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if is_token_list(prompt):
            return [list(prompt)]
        return list(prompt)

    def to_sampling_params(
        self, max_logprobs: int = limits.MAX_LOGPROBS, defaults: SamplingDefaults | None = None
    ) -> SamplingParams:
        self.check_stream_options()
        defaults = defaults or {}
        max_tokens = (
            self.max_tokens if "max_tokens" in self.model_fields_set else defaults.get("max_tokens", self.max_tokens)
        )
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise InvalidRequestError(
                f"logprobs: must be at most {max_logprobs} (the server's max_logprobs), got {self.logprobs}", "logprobs"
            )
        if self.suffix:
            raise InvalidRequestError("suffix: not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of: only best_of equal to n is supported", "best_of")
        if max_tokens == 0 and not self.echo:
            raise InvalidRequestError(
                "max_tokens: must be at least 1; 0 is allowed only with echo (the prompt and its "
                "logprobs, nothing generated)",
                "max_tokens",
            )
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# --- /v1/chat/completions ---


class ContentPart(_Request):
    """Any content part; only text ones are served (the check names the message)."""

    type: Name
    text: Text | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=limits.MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=limits.MAX_TOOLS)] | None = None  # assistant's, earlier
    tool_call_id: Name | None = None  # a tool message answers this call

    def as_template_message(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            kinds = sorted({part.type for part in content} - {"text"})
            if kinds:
                raise InvalidRequestError(
                    f"messages[{index}].content: parts of type {kinds} are not supported; send text parts only",
                    f"messages[{index}].content",
                )
            content = "".join(part.text or "" for part in content)
        # Chat templates know system/user/assistant; OpenAI's "developer" is the newer name for "system".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=limits.MAX_MESSAGES)]
    max_tokens: Annotated[int, Field(ge=1, le=limits.INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=limits.INT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=limits.MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=limits.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None  # OpenAI's default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Annotated[dict[Name, FreeJSON], Field(max_length=limits.MAX_TEMPLATE_KWARGS)] | None = None

    def to_sampling_params(
        self, max_logprobs: int = limits.MAX_LOGPROBS, defaults: SamplingDefaults | None = None
    ) -> SamplingParams:
        self.check_stream_options()
        if self.top_logprobs is not None and self.top_logprobs > max_logprobs:
            raise InvalidRequestError(
                f"top_logprobs: must be at most {max_logprobs} (the server's max_logprobs), got {self.top_logprobs}",
                "top_logprobs",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs set to true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:  # neither given: the model's max_new_tokens, else up to the end of the context
            max_tokens = (defaults or {}).get("max_tokens")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.sampling_params(max_tokens, logprobs, defaults=defaults)
        forced, _ = forced_tool_output(self.tools, self.tool_choice, self.parallel_tool_calls)
        if forced is not None:
            if params.structured is not None:
                raise InvalidRequestError(
                    f"tool_choice: a required or named tool call cannot be combined with {params.structured.param}",
                    "tool_choice",
                )
            params.structured = forced
        return params

    @property
    def tool_mode(self) -> str:
        """ "named", "required", "auto" (parse the output for calls) or "none"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """OpenAI streams a call as its id, type and name first, then pieces of its arguments, by index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # OpenAI's deltas carry only the keys that changed: {"role": ...} first, then {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# --- /v1/models ---


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "capstan"
    root: str | None = None  # the checkpoint's name; a LoRA adapter's path
    parent: str | None = None  # a LoRA adapter's base model (its first served name)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- errors ---


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
