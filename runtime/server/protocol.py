"""OpenAI's request and response bodies as pydantic models, with vLLM's extra sampling fields.

Unknown fields are ignored (SDKs send fields we do not use); fields we know are type-checked, and values
the engine cannot honour are refused in `to_sampling_params` or by `SamplingParams.validate`.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ..engine.sampling_params import InvalidRequestError, SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None):
        bias = None
        if self.logit_bias:
            try:
                bias = {int(token): value for token, value in self.logit_bias.items()}
            except ValueError:
                raise InvalidRequestError("logit_bias: keys must be token ids (integers as strings)", "logit_bias")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        defaults = SamplingParams()
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=defaults.repetition_penalty if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            seed=self.seed,
            stop=stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


# --- /v1/completions ---


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One engine request per prompt: a string, a list of strings, one token list or several."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt: must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if any(isinstance(p, list) and not p for p in prompt):
            raise InvalidRequestError("prompt: token lists must not be empty", "prompt")
        return list(prompt)

    def to_sampling_params(self) -> SamplingParams:
        self.check_stream_options()
        if self.suffix:
            raise InvalidRequestError("suffix: not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of: only best_of equal to n is supported", "best_of")
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


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


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ContentPart(_Request):
    """Any content part; only text ones are served (the check names the message)."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

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
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        self.check_stream_options()
        if not self.messages:
            raise InvalidRequestError("messages: must hold at least one message", "messages")
        if self.tools:
            raise InvalidRequestError("tools: tool calling is not supported by this server", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("response_format: only {\"type\": \"text\"} is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs set to true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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
    root: str | None = None
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
