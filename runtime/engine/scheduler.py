"""Scheduler: which sequences run in the next step and how many tokens each computes (host Python).

Every step has a token budget and a sequence cap. Running sequences go first (a decode is one token, an
unfinished chunked prefill takes what the budget leaves), then waiting ones in arrival order. When pages
run out, the most recently admitted running sequence is preempted: its pages are freed and it is
recomputed later (the prefix cache usually makes that cheap)."""
from __future__ import annotations

import collections
import dataclasses

from ..kv.page_pool import PagePool, page_hash
from .sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step
    num_tokens: int
    draft: list[int] = dataclasses.field(default_factory=list)  # proposed tokens verified after these (speculation)

    @property
    def num_step_tokens(self) -> int:
        return self.num_tokens + len(self.draft)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence's tokens, so the step samples its next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.failed: list[tuple[Sequence, BaseException]] = []  # admissions that raised: their requests fail

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, n, preempt=True):
                break  # seq itself was preempted, and it was the last running sequence
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            fresh = seq.num_computed == 0 and not seq.pages
            try:
                if fresh and seq.params.prompt_logprobs is None:  # cached prompt tokens would have no logprobs
                    seq.pages, seq.page_hashes = self.pool.lookup(seq.token_ids)
                    seq.num_computed = len(seq.pages) * self.pool.page_size
                n = min(seq.num_uncomputed, budget)
                admitted = self._reserve(seq, n, preempt=False)
            except Exception as e:  # noqa: BLE001 - this request's own fault: the engine fails it alone
                self.waiting.popleft()
                self._free(seq)
                self.failed.append((seq, e))
                continue
            if not admitted:
                if fresh:
                    self._free(seq)
                break
            if fresh:
                seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed)
                self.prefix_queried_tokens += len(seq.prompt_ids)
                self.prefix_hit_tokens += min(seq.num_computed, len(seq.prompt_ids))
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        return chunks

    def take_failed(self) -> list[tuple[Sequence, BaseException]]:
        failed, self.failed = self.failed, []
        return failed

    def _reserve(self, seq: Sequence, n: int, preempt: bool) -> bool:
        """Allocates the pages for seq's next n tokens, preempting later running sequences if allowed."""
        page = self.pool.page_size
        need = -(-(seq.num_computed + n) // page) - len(seq.pages)
        while need > self.pool.num_free:
            if not preempt:
                return False
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages.extend(self.pool.allocate(need))
        return True

    def reserve_ahead(self, seq: Sequence, n: int) -> bool:
        """Pages for n tokens from seq.num_computed (a multi-step decode); never preempts."""
        return self._reserve(seq, n, preempt=False)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        self.num_preemptions += 1
        self.add(seq, front=True)

    def finish(self, seq: Sequence) -> None:
        """Takes seq out of the queues and frees its pages (finished or aborted)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    def _free(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages, seq.page_hashes, seq.num_computed, seq.num_draft_computed = [], [], 0, 0

    def register_full_pages(self, seq: Sequence) -> None:
        """After a step: name the pages it filled, so the prefix cache can share them."""
        if not self.pool.enable_prefix_caching:
            return
        page = self.pool.page_size
        for k in range(len(seq.page_hashes), seq.num_computed // page):
            parent = seq.page_hashes[-1] if seq.page_hashes else None
            h = page_hash(parent, seq.token_ids[k * page:(k + 1) * page])
            seq.page_hashes.append(h)
            self.pool.register(seq.pages[k], h)
