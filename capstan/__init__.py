"""Capstan: `from capstan import LLM, SamplingParams, LoRARequest` (the offline API, in vLLM's shape).

The names load on first use, so `import capstan.operator` never imports JAX."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("capstan")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

_EXPORTS = {
    "LLM": "capstan.runtime.engine.llm",
    "SamplingParams": "capstan.runtime.sampling.sampling_params",
    "EngineConfig": "capstan.runtime.config",
    "RequestOutput": "capstan.runtime.engine.outputs",
    "CompletionOutput": "capstan.runtime.engine.outputs",
    "EmbeddingRequestOutput": "capstan.runtime.engine.outputs",
    "LoRARequest": "capstan.runtime.lora.request",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'capstan' has no attribute {name!r}")
