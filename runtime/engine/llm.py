"""LLM: the offline batch API in vLLM's shape: LLM(model).generate(prompts, SamplingParams), .chat(), .embed()."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from ..config import EngineConfig
from ..generation_config import sampling_defaults
from ..lora.request import LoRARequest
from ..sampling.sampling_params import SamplingParams
from .engine import LLMEngine
from .outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput

# What generate() and embed() take, as vLLM does: a string, token ids, {"prompt": ...} or {"prompt_token_ids": ...},
# or a list of any of these.
PromptType = str | Sequence[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """engine_args: EngineConfig's fields. warmup is False unless given: a batch compiles only the step shapes its
        prompts take, as they come (the default model on a 2-core machine: ~22 s to construct against ~137 s with
        every shape compiled first, as `capstan serve` does so that no request waits on a compile)."""
        engine_args.setdefault("warmup", False)
        config = EngineConfig(model=model, **engine_args)  # None: the default model, as `capstan serve` serves
        config.validate()
        self.sampling_defaults = sampling_defaults(config)  # the model's generation config, and the override
        self.engine = LLMEngine(config)
        if config.warmup:
            self.engine.warmup()
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: the model's recommended sampling (vLLM's)."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion, batched; results in the order of the prompts. lora_request: the LoRA
        adapter of every prompt, or one per prompt (None: the base model); needs LLM(..., enable_lora=True)."""
        prompts = [_engine_prompt(p, i) for i, p in enumerate(_as_list(prompts))]
        params = _per_prompt(sampling_params or self.get_default_sampling_params(), len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        loras = [lora_request] * len(prompts) if isinstance(lora_request, LoRARequest | None) else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for p in params:  # validate all before queueing any
            self.engine.validate(p)
        for rid, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
            self.engine.add_request(rid, prompt, copy.copy(p), lora_request=lora)
        results: dict[str, Any] = {rid: None for rid in ids}
        with tqdm(total=len(ids), desc="Processed prompts", unit="prompt", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    results[delta.request_id] = merge(results[delta.request_id], delta)
                    bar.update(int(delta.finished))
                self._raise_failed(ids)
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, rendered with the
        checkpoint's chat template; each stops at the template's end-of-turn token, as the server's chat does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {
                "prompt_token_ids": self.tokenizer.apply_chat_template(
                    list(c), add_generation_prompt=add_generation_prompt, tokenize=True, **(chat_template_kwargs or {})
                )
            }
            for c in conversations
        ]
        params = _per_prompt(sampling_params or self.get_default_sampling_params(), len(prompts))
        stops = self.tokenizer.end_of_turn_ids()
        params = [
            p
            if p.ignore_eos
            else dataclasses.replace(p, stop_token_ids=sorted(set(p.stop_token_ids or []) | set(stops)))
            for p in params
        ]
        return self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One unit-length embedding per prompt (the pooling of EngineConfig.embedding_pooling), in prompt order."""
        prompts = [_engine_prompt(p, i) for i, p in enumerate(_as_list(prompts))]
        embedder = self.engine.embedder
        ids = [f"embed-{next(self._ids)}" for _ in prompts]
        inputs = [
            embedder.prepare(rid, [p]) for rid, p in zip(ids, prompts, strict=True)
        ]  # validate all before queueing any
        for x in inputs:
            embedder.add(x)
        results: dict[str, EmbeddingRequestOutput] = {}
        with tqdm(total=len(ids), desc="Embedded prompts", unit="prompt", disable=not use_tqdm) as bar:
            while embedder.has_work():
                for rid, (out,) in embedder.step():
                    results[rid] = dataclasses.replace(out, request_id=rid)
                    bar.update(1)
                self._raise_failed(ids)
        return [results[rid] for rid in ids]

    def _raise_failed(self, ids: list[str]) -> None:
        for rid, error in self.engine.take_failed():  # offline, one failed prompt fails the call
            for other in ids:
                self.engine.abort(other)
                self.engine.embedder.abort(other)
            raise RuntimeError(
                f"prompt {ids.index(rid)} failed in the engine: {type(error).__name__}: {error}"
            ) from error


def _per_prompt(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    """One SamplingParams for all n prompts, or one each."""
    return [params] * n if isinstance(params, SamplingParams) else list(params)


def _as_list(prompts) -> list:
    """One prompt (a string, a dict, or token ids) or a list of them."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _engine_prompt(prompt, index: int) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise TypeError(
            f"prompts[{index}]: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
        )
    if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise TypeError(f"prompts[{index}]: expected a string, token ids or a dict, got {type(prompt).__name__}")


def merge(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Accumulates a delta RequestOutput into the running total."""
    if total is None:
        total = dataclasses.replace(delta, outputs=[])
    by_index = {o.index: o for o in total.outputs}
    for o in delta.outputs:
        acc = by_index.setdefault(
            o.index, CompletionOutput(index=o.index, logprobs=[] if o.logprobs is not None else None)
        )
        acc.text += o.text
        acc.token_ids = acc.token_ids + o.token_ids
        if o.logprobs is not None:
            acc.logprobs = (acc.logprobs or []) + o.logprobs
        acc.finish_reason, acc.stop_reason = o.finish_reason, o.stop_reason
    total.outputs = sorted(by_index.values(), key=lambda o: o.index)
    total.finished = delta.finished
    total.prompt_logprobs = total.prompt_logprobs or delta.prompt_logprobs
    total.num_cached_tokens = delta.num_cached_tokens
    return total
