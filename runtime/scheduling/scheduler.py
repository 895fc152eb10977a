"""Scheduler: which sequences run in the next step and how many tokens each computes (host Python).

Every step has a token budget and a sequence cap. Running sequences go first (a decode is one token, an
unfinished chunked prefill takes what the budget leaves), then waiting ones in arrival order. When pages
run out, the most recently admitted running sequence is preempted: its pages are freed and it is
recomputed later (the prefix cache usually makes that cheap).

With a host-memory tier under the prefix cache (kv/host_offload.py), a fresh sequence whose prefix goes on past
its device hit in pages that the tier holds gets device pages for them and waits in `loading` while they are
copied back; the next poll after they land admits it at the front of the queue with them computed (or, if the copy
failed or was late, with them to recompute). With a tier that writes loads at once (LOAD_WAY "same-step") the
sequence is admitted in the schedule that starts its load instead, in `writing` until the engine writes the pages,
before the step that computes on them; they are named in the prefix cache only once written. A preempted sequence
comes back as a fresh one: its pages, evicted meanwhile, are copied back the same way."""

from __future__ import annotations

import collections
import dataclasses
import time

from ..kv.host_offload import HostOffload
from ..kv.page_pool import PageHash, PagePool
from ..lora.manager import LoRAManager
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
        self.offload: HostOffload[Sequence] | None = None  # the prefix cache's host-memory tier (attach_host_tier)
        # waiting for these pages to come back from host memory, since when
        self.loading: dict[Sequence, tuple[list[PageHash], float]] = {}
        self.restored: dict[Sequence, int] = {}  # back in the queue after a load: tokens the host tier supplied
        # admitted in this schedule with pages its load writes before the step (a tier's `at_once`): their hashes
        self.writing: dict[Sequence, list[PageHash]] = {}
        self.host_queried_tokens = 0  # prompt tokens the device tier did not have, looked up in the host tier
        self.host_hit_tokens = 0
        self.host_saved_seconds = 0.0  # estimated: restored tokens at the measured prefill cost, less the waits
        self.prefill_seconds_per_token = 0.0  # moving average over steps that were mostly prefill
        self._last_step: tuple[float, int] | None = None  # (when the last schedule ran, its prefill tokens)
        self.lora: LoRAManager | None = None  # LoRA adapters' device slots: a sequence is admitted once it has one
        self.lora_blocked: set[Sequence] = set()  # waited for their adapter's slot at the last schedule

    def attach_host_tier(self, offload: HostOffload[Sequence]) -> None:
        self.offload = offload
        self.pool.on_evict = offload.on_evict

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        if self.offload is not None and self.offload.prefetches and seq.params.prompt_logprobs is None:
            self._prefetch(seq)

    def _prefetch(self, seq: Sequence) -> None:
        """Starts copying to the device the tier's pages that would follow seq's device hit if it were admitted now
        (LOAD_WAY "arrival"): they start once the dispatch under way has run, and its load at admission takes them."""
        assert self.offload is not None, "called only with a host tier"
        if not self.pool.enable_prefix_caching or seq.pages:
            return
        self.offload.prefetch(seq, self._host_run(seq, self._device_hit(seq))[1])

    def _device_hit(self, seq: Sequence) -> int:
        """How many of seq's full pages a lookup would find on the device now (none is taken)."""
        first = 0
        for h in self._lookup_hashes(seq):
            if not self.pool.holds(h):
                break
            first += 1
        return first

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def admissible_waiting(self) -> bool:
        """Some waiting sequence could be admitted at a step: not all of them wait for their LoRA adapter's slot. (A
        slot frees only when a running sequence ends, and a multi-step run ends there while anything waits.)"""
        if not self.lora_blocked:
            return bool(self.waiting)
        return any(seq not in self.lora_blocked for seq in self.waiting)

    @property
    def lora_waiting(self) -> int:
        return len(self.lora_blocked)

    def blocked_on_adapters(self) -> bool:
        """Nothing runs and only LoRA adapters' files being read hold the waiting back (the engine waits a moment)."""
        return not self.running and self.lora is not None and self.lora.reading

    def schedule(self) -> list[ScheduledChunk]:
        if self.offload is not None:
            self._time_prefill()
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
        deferred: list[Sequence] = []  # waiting for their LoRA adapter's slot: the sequences behind them go first
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora is not None and seq.lora_slot < 0 and self.lora is not None:
                try:
                    slot = self.lora.acquire(seq.lora)
                except Exception as e:  # noqa: BLE001 - its adapter cannot be read any more: it fails alone
                    self.waiting.popleft()
                    self._free(seq)
                    self.failed.append((seq, e))
                    continue
                if slot is None:
                    deferred.append(self.waiting.popleft())
                    continue
                seq.lora_slot = slot
            fresh = seq.num_computed == 0 and not seq.pages
            restored = self.restored.get(seq)  # its pages were just copied back: admitted as a fresh one is
            try:
                # cached prompt tokens would have no logprobs; without the cache its hashes are not worth computing
                if fresh and seq.params.prompt_logprobs is None and self.pool.enable_prefix_caching:
                    seq.pages, seq.page_hashes = self.pool.lookup(self._lookup_hashes(seq))
                    seq.num_computed = len(seq.pages) * self.pool.page_size
                    if self.offload is not None and self._load_from_host(seq):
                        restored = self._write_at_once(seq, budget)
                        if restored is None:  # it waits in `loading` for a poll to write its pages
                            self.waiting.popleft()
                            continue
                    if self.offload is not None:
                        self.offload.drop_prefetch(seq)  # copies started at arrival that its load did not take
                n = min(seq.num_uncomputed, budget)
                admitted = self._reserve(seq, n, preempt=False)
            except Exception as e:  # noqa: BLE001 - this request's own fault: the engine fails it alone
                self.waiting.popleft()
                self._free(seq)
                self.failed.append((seq, e))
                continue
            if not admitted:
                if fresh:
                    self._free(seq)  # (a load started for it is cancelled: its pages go back unwritten)
                for waiter in list(self.restored):  # while the front waits for pages, no waiter holds any
                    self._free(waiter)  # (their restored pages stay cached, unreferenced, until evicted)
                break
            if fresh or restored is not None:
                self.restored.pop(seq, None)
                prompt, host = len(seq.prompt_ids), min(restored or 0, len(seq.prompt_ids))
                device = min(seq.num_computed, prompt) - host
                seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed)
                self.prefix_queried_tokens += prompt
                self.prefix_hit_tokens += device
                if self.offload is not None:
                    self.host_queried_tokens += prompt - device
                    self.host_hit_tokens += host
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        self.lora_blocked = set(deferred)
        return self._count_prefill(chunks) if self.offload is not None else chunks

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

    def _load_from_host(self, seq: Sequence) -> bool:
        """Starts copying back the full pages after seq's device hit that the host tier holds (one token is always
        left to compute); True: seq waits in `loading` for them."""
        assert self.offload is not None, "called only with a host tier"
        hashes, slots = self._host_run(seq, len(seq.pages))
        count = min(len(slots), self.pool.num_free - self.offload.restore_headroom * len(self.running))
        if count <= 0:
            return False
        pages = self.pool.allocate(count)
        if not self.offload.start_load(seq, pages, slots[:count]) and self.offload.at_once:
            self.offload.cancel(seq)  # (loads that wait report the failure at the poll: the same recompute)
            self.pool.release(pages)
            return False
        seq.pages.extend(pages)
        self.loading[seq] = (hashes[:count], time.monotonic())
        return True

    def _lookup_hashes(self, seq: Sequence) -> list[PageHash]:
        """The hashes of seq's full pages a prefix lookup may find (one token is always left to compute)."""
        return seq.full_page_hashes(self.pool.page_size, (seq.num_tokens - 1) // self.pool.page_size)

    def _host_run(self, seq: Sequence, first: int) -> tuple[list[PageHash], list[int]]:
        """The hashes and host tier slots of seq's full pages from page `first` on that the tier holds one after
        another (one token is always left to compute)."""
        assert self.offload is not None, "called only with a host tier"
        hashes = self._lookup_hashes(seq)[first:]
        slots = self.offload.match(hashes)
        return hashes[: len(slots)], slots

    def _write_at_once(self, seq: Sequence, budget: int) -> int | None:
        """With a tier that writes loads at once, and pages free for seq's next chunk: its load (just started) is
        written before this schedule's step, so it counts those pages computed now and waits in `writing`; the tokens
        they hold. None: it waits in `loading` (admitted once a poll wrote them, the room for its chunk found then)."""
        assert self.offload is not None, "called only with a host tier"
        if not self.offload.at_once:
            return None
        hashes, _ = self.loading[seq]
        page = self.pool.page_size
        computed = (len(seq.page_hashes) + len(hashes)) * page
        chunk_end = computed + min(seq.num_tokens - computed, budget)
        if -(-chunk_end // page) - len(seq.pages) > self.pool.num_free:  # no room to admit it in this schedule
            return None
        del self.loading[seq]
        self.writing[seq] = hashes
        seq.num_computed = computed
        return len(hashes) * page

    def poll_host_tier(self, read_kv):
        """Finishes the copies between the tiers that are ready (the engine calls this before each step, and after a
        schedule that left sequences `writing`): returns the cache with restored pages written (None: no load
        landed, the cache was not read), and puts the sequences that waited for theirs at the front of the queue."""
        assert self.offload is not None, "called only with a host tier"
        kv, ended = self.offload.poll(read_kv)
        for seq, loaded in reversed(ended):
            if seq in self.writing:  # admitted already: its pages are named now that they are written
                assert loaded, "a load written at once started (else it was cancelled) and is never late"
                self._name_loaded(seq, self.writing.pop(seq), time.monotonic())
                continue
            hashes, started = self.loading.pop(seq)
            if loaded:
                self._name_loaded(seq, hashes, started)
                seq.num_computed = len(seq.page_hashes) * self.pool.page_size
            self.restored[seq] = len(hashes) * self.pool.page_size if loaded else 0
            self.waiting.appendleft(seq)
        return kv

    def _name_loaded(self, seq: Sequence, hashes: list[PageHash], started: float) -> None:
        """The pages after seq's device hit hold what hashes name: the prefix cache can share them."""
        first = len(seq.page_hashes)
        for k, h in enumerate(hashes):
            self._register(seq, first + k, h, hashes[k - 1] if k else seq.page_hashes[-1] if first else seq.hash_root)
        seq.page_hashes.extend(hashes)
        if self.prefill_seconds_per_token:  # (not measured yet: no estimate)
            recompute = len(hashes) * self.pool.page_size * self.prefill_seconds_per_token
            self.host_saved_seconds += recompute - (time.monotonic() - started)

    def host_tier_stats(self) -> dict:
        """EngineStats' kv_offload_* fields (zeros without a tier)."""
        o = self.offload
        if o is None:
            return {}
        return dict(
            kv_offload_pages_used=o.tier.num_used,
            kv_offload_pages_total=o.tier.capacity,
            kv_offload_queried_tokens=self.host_queried_tokens,
            kv_offload_hit_tokens=self.host_hit_tokens,
            kv_offload_bytes_to_host=o.bytes_to_host,
            kv_offload_bytes_to_device=o.bytes_to_device,
            kv_offload_failed_loads=o.failed_loads,
            kv_offload_saved_seconds=self.host_saved_seconds,
        )

    def _time_prefill(self) -> None:
        """The step loop's seconds per prefill token, from the time between schedules after mostly-prefill steps
        (what a restored page would have cost to recompute)."""
        now = time.monotonic()
        if self._last_step is not None:
            then, tokens = self._last_step
            if tokens >= self.max_num_batched_tokens // 2 and now - then < 5.0:  # longer: the loop was idle
                cost = (now - then) / tokens
                self.prefill_seconds_per_token = (
                    cost if not self.prefill_seconds_per_token else 0.9 * self.prefill_seconds_per_token + 0.1 * cost
                )
        self._last_step = (now, 0)

    def _count_prefill(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        if self._last_step is not None:
            prefill = sum(c.num_tokens for c in chunks if c.seq.in_prefill)
            self._last_step = (self._last_step[0], prefill)
        return chunks

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
            if self.offload is not None:
                self.offload.drop_prefetch(seq)
        elif seq in self.loading:  # its copy is dropped before it writes: the pages go back unwritten
            del self.loading[seq]
            assert self.offload is not None, "sequences load only from a host tier"
            self.offload.cancel(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    def _free(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        if seq.lora_slot >= 0 and self.lora is not None:  # the slot may go to another adapter once none holds it
            self.lora.release(seq.lora_slot)
            seq.lora_slot = -1
        self.restored.pop(seq, None)
        if self.writing.pop(seq, None) is not None:  # its pages were never written: they go back unnamed
            assert self.offload is not None, "sequences load only from a host tier"
            self.offload.cancel(seq)
        seq.pages, seq.page_hashes, seq.num_computed, seq.num_draft_computed = [], [], 0, 0

    def register_full_pages(self, seq: Sequence) -> None:
        """After a step: name the pages it filled, so the prefix cache can share them."""
        if not self.pool.enable_prefix_caching:
            return
        count = seq.num_computed // self.pool.page_size
        if count <= len(seq.page_hashes):  # (most steps: no page filled)
            return
        full = seq.full_page_hashes(self.pool.page_size, count)
        for k in range(len(seq.page_hashes), count):
            seq.page_hashes.append(full[k])
            self._register(seq, k, full[k], full[k - 1] if k else seq.hash_root)

    def _register(self, seq: Sequence, k: int, h: PageHash, parent: PageHash | None) -> None:
        """Names seq's k-th page h (chained from parent) in the prefix cache; with KV events on, records it with what
        a consumer needs to name it too."""
        if self.pool.register(seq.pages[k], h) and self.pool.events is not None:
            size = self.pool.page_size
            lora_id = None if seq.lora is None else seq.lora.request.lora_int_id
            self.pool.events.stored(h, parent, seq.token_ids[k * size : (k + 1) * size], lora_id)
