"""Sequence: one choice of one request as the scheduler sees it: its tokens, its pages, how far it is computed."""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

from ..kv.page_pool import PageHash, chained_page_hashes
from ..lora.request import Adapter
from ..sampling.grammar import TokenConstraint
from ..sampling.logprobs import PositionLogprobs
from ..sampling.sampling_params import SamplingParams


class ChoiceTextState(Protocol):
    """A choice's text as its tokens arrive: engine/choice_text.py's ChoiceText, which the engine makes and reads; a
    sequence only carries it."""

    @property
    def stop(self) -> str | None: ...

    def add(self, token: int) -> tuple[str, bool]: ...

    def finish(self) -> str: ...


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n choices
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or one drawn for it
    arrival: float
    text: ChoiceTextState | None  # None: token ids only (detokenize off, or the engine core's frontend makes the text)
    max_tokens: int  # resolved against the context length
    prompt_text: str | None = None
    constraint: TokenConstraint | None = None  # structured outputs: the grammar's state after its tokens
    lora: Adapter | None = None  # its LoRA adapter (None: the base model)
    lora_slot: int = -1  # the device slot its adapter is in while it holds one (lora/manager.py); -1: none
    token_ids: list[int] = dataclasses.field(default_factory=list)  # prompt then output
    pages: list[int] = dataclasses.field(default_factory=list)
    page_hashes: list[PageHash] = dataclasses.field(default_factory=list)  # of the full pages, in order
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_draft_computed: int = 0  # tokens whose draft model's K/V are in its cache (speculative decoding)
    num_cached_tokens: int = 0  # prompt tokens that the prefix cache supplied
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    pending_forks: list[Sequence] = dataclasses.field(default_factory=list)  # choices 1..n-1, until prefill ends
    # asynchronous scheduling (engine.py): its last token, PENDING in token_ids, is the sample of this row of the
    # step still on the device; None: every token is known on the host
    pending_row: int | None = None
    prompt_logprobs_done: bool = False
    # produced since the owner last collected them
    new_text: str = ""
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    new_logprobs: list[PositionLogprobs] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    reported_finish: bool = False
    prompt_logprobs_sent: bool = False
    # the chained hashes of its first full pages, each computed once (tokens only ever append; `full_page_hashes`)
    hashed_pages: list[PageHash] = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def hash_root(self) -> PageHash | None:
        """The parent of its first page's hash: its adapter's, so no prefix is shared across adapters."""
        return None if self.lora is None else self.lora.hash_root

    def full_page_hashes(self, page_size: int, count: int) -> list[PageHash]:
        """The chained page hashes (page_pool.page_hash, from hash_root) of its first `count` full pages: the device
        and host tiers' lookups, prefetches and registration read them, so each page is hashed once."""
        if len(self.hashed_pages) < count:
            parent = self.hashed_pages[-1] if self.hashed_pages else self.hash_root
            fresh = self.token_ids[len(self.hashed_pages) * page_size : count * page_size]
            self.hashed_pages += chained_page_hashes(parent, fresh, page_size)
        return self.hashed_pages[:count]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
