"""LLM: the offline batch API in vLLM's shape: LLM(model).generate(prompts, SamplingParams)."""
from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Sequence

from ..config import EngineConfig
from .engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        config = EngineConfig(**engine_args) if model is None else EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(config)
        if config.warmup:
            self.engine.warmup()
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion, batched; results in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):  # validate all before queueing any
            self.engine.validate(p)
        for rid, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(rid, prompt if isinstance(prompt, str) else list(prompt), copy.copy(p))
        results = {rid: None for rid in ids}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                results[delta.request_id] = merge(results[delta.request_id], delta)
            for rid, error in self.engine.take_failed():  # offline, one failed prompt fails the call
                for other in ids:
                    self.engine.abort(other)
                raise RuntimeError(f"prompt {ids.index(rid)} failed in the engine: {type(error).__name__}: "
                                   f"{error}") from error
        return [results[rid] for rid in ids]


def merge(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Accumulates a delta RequestOutput into the running total."""
    if total is None:
        total = dataclasses.replace(delta, outputs=[])
    by_index = {o.index: o for o in total.outputs}
    for o in delta.outputs:
        acc = by_index.setdefault(o.index, CompletionOutput(index=o.index, logprobs=[] if o.logprobs is not None else None))
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
