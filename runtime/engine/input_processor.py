"""InputProcessor: a request validated and tokenized before it reaches the engine (the frontend's half of
admission). It needs the tokenizer and the model's limits only, never engine state, so a frontend process without
the device runs it; the engine core then builds sequences from the EngineRequest it gets."""

from __future__ import annotations

import dataclasses
import secrets

from ..sampling.grammar import GrammarTokenizer
from ..sampling.sampling_params import InvalidRequestError, SamplingParams
from ..tokenizer import Tokenizer


@dataclasses.dataclass
class ModelLimits:
    """What admission checks a request against: the engine core tells its frontends once the model is loaded."""

    vocab_size: int
    max_model_len: int
    page_size: int
    num_pages: int
    max_num_seqs: int
    max_logprobs: int
    eos_token_ids: list[int]
    hidden_size: int  # an embedding's dimensions

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


@dataclasses.dataclass
class EngineRequest:
    """One generation request as the engine core receives it: token ids, sampling fields, resolved limits."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context: 0 scores the prompt and samples nothing
    seed: int  # the request's seed, or one drawn for it
    prompt_text: str | None = None
    text_in_engine: bool = True  # False: the engine sends token ids only; its frontend detokenizes, stop strings too
    lora_name: str | None = None  # the LoRA adapter it runs with (registered in the engine); None: the base model


@dataclasses.dataclass
class EmbeddingRequest:
    request_id: str
    inputs: list[list[int]]  # one token-id list per input


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, limits: ModelLimits, grammar: GrammarTokenizer | None = None):
        self.tokenizer, self.limits = tokenizer, limits
        self.grammar = grammar or GrammarTokenizer(
            tokenizer, set(tokenizer.end_of_turn_ids()) | set(limits.eos_token_ids), limits.vocab_size
        )
        # Text longer than this cannot fit the context (x2: normalisers may compose characters), so it is refused
        # before the tokenizer spends time and memory on it.
        self.max_prompt_chars = 2 * limits.max_model_len * tokenizer.max_token_chars

    def validate(self, params: SamplingParams) -> None:
        """Every sampling field within its limit for this model and configuration (InvalidRequestError)."""
        limits = self.limits
        params.validate(vocab_size=limits.vocab_size, max_n=limits.max_num_seqs, max_logprobs=limits.max_logprobs)
        if params.structured is not None and (error := self.grammar.check(params.structured)):
            raise InvalidRequestError(f"{params.structured.param}: {error}", params.structured.param)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{param}: {chars} characters cannot fit this model's maximum context length of "
                f"{self.limits.max_model_len} tokens (at most {self.max_prompt_chars} characters)",
                param,
            )

    def token_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """The prompt's ids: text tokenized (after the length check), ids checked against the vocabulary."""
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), param)
            ids = self.tokenizer.encode(prompt)
        else:
            ids, vocab = list(prompt), self.limits.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"{param}: token ids must be in [0, {vocab})", param)
        if not ids:
            raise InvalidRequestError(f"{param}: must not be empty", param)
        return ids

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> EngineRequest:
        self.validate(params)
        ids, limit = self.token_ids(prompt, "prompt"), self.limits.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompt: this model's maximum context length is {limit} tokens, and the prompt has {len(ids)} "
                f"tokens (at least one token must remain for the output)",
                "prompt",
            )
        room = limit - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens: this model's maximum context length is {limit} tokens; the prompt has {len(ids)}, so "
                f"max_tokens can be at most {room}, got {params.max_tokens}",
                "max_tokens",
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        pages_needed, num_pages = self.limits.pages_for(len(ids) + max_tokens), self.limits.num_pages
        if pages_needed > num_pages:
            raise InvalidRequestError(
                f"max_tokens: prompt plus output need {pages_needed} KV pages, the pool has {num_pages}", "max_tokens"
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return EngineRequest(
            request_id, ids, params, max_tokens, seed, prompt_text=prompt if isinstance(prompt, str) else None
        )

    def embedding(self, request_id: str, prompts: list[str | list[int]]) -> EmbeddingRequest:
        inputs, limits = [], self.limits
        for i, prompt in enumerate(prompts):
            param = "input" if len(prompts) == 1 else f"input[{i}]"
            ids = self.token_ids(prompt, param)
            if len(ids) > limits.max_model_len:
                raise InvalidRequestError(
                    f"{param}: this model's maximum context length is {limits.max_model_len} "
                    f"tokens, and the input has {len(ids)} tokens",
                    param,
                )
            if limits.pages_for(len(ids)) > limits.num_pages:
                raise InvalidRequestError(
                    f"{param}: {len(ids)} tokens need more KV pages than the pool has ({limits.num_pages})", param
                )
            inputs.append(ids)
        return EmbeddingRequest(request_id, inputs)
