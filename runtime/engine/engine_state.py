"""What the engine's decode strategies (multi_step.py; speculative.py works the same way) use of the LLMEngine that
owns them: typed here, so that they never import engine.py, which imports them."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..config import EngineConfig
from ..kv.cache import KVCache
from ..models.decoder import DecoderModel
from ..parallel.tensor_parallel import TensorParallel
from ..sampling.sampler import SampleResult
from ..scheduling.batch import BatchBuilder
from ..scheduling.scheduler import ScheduledChunk, Scheduler
from ..scheduling.sequence import Sequence
from .outputs import RequestOutput


class EngineState(Protocol):
    config: EngineConfig
    model: DecoderModel
    builder: BatchBuilder
    parallel: TensorParallel
    scheduler: Scheduler
    requests: dict[str, list[Sequence]]
    max_model_len: int
    speculator: Any  # the engine's Speculator, or None
    warming: Any  # serve's BackgroundWarmup while it still compiles (engine/warmup.py), else None
    program_store: Any  # serve's ProgramStore (engine/program_store.py), else None
    kv: KVCache  # reading it settles the cache (host-tier copies are queued first); _kv is the cache as it is
    _kv: KVCache

    def fail(self, request_id: str, error: BaseException) -> None: ...

    def model_for(self, chunks: list[ScheduledChunk]) -> DecoderModel: ...

    def variant_of(self, chunks: list[ScheduledChunk]) -> str: ...

    def compiled(self, key: Any) -> bool: ...

    def fetch(self, out: Any) -> Any: ...

    def _build(
        self, chunks: list[ScheduledChunk], bucket: int | None = None, masks: bool = True, rows: int | None = None
    ) -> Any: ...

    def _collect_all(self, request_ids: Any) -> list[RequestOutput]: ...

    def _precision(self) -> AbstractContextManager: ...

    def _append_token(
        self, seq: Sequence, token: int, s: SampleResult, at: Any, grammar_done: bool | None = None
    ) -> None: ...
