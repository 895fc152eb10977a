"""BatchBuilder: turns the scheduler's chunks into the padded host arrays of one step."""

from __future__ import annotations

import bisect
import hashlib
from typing import Generic, TypedDict

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Sharding

from ..arrays import HostLeaf, HostOrDevice
from ..attention import INVALID_SLOT, AttentionMetadata, query_blocks
from ..limits import MAX_LOGIT_BIAS
from ..parallel.placement import put
from ..sampling.grammar import fill_masks, mask_words
from ..sampling.sampler import SamplingBatch
from .packing import Packed, pack
from .scheduler import ScheduledChunk

MAX_BANNED = 48  # eos ids + stop_token_ids banned while below min_tokens


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest`, ending exactly at max_tokens: each is one compiled program."""
    buckets, b = [], smallest
    while b < max_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_tokens]


def row_buckets(max_rows: int) -> list[int]:
    """Decode-step row counts: powers of four from 1, ending exactly at max_rows (few programs, at most 4x the
    rows a step has)."""
    buckets, b = [], 1
    while b < max_rows:
        buckets.append(b)
        b *= 4
    return buckets + [max_rows]


def row_key_data(seed: int, index: int) -> tuple[int, int]:
    """A choice's 64-bit threefry key from its request's seed and its index among the n choices."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


class StepInputs(eqx.Module, Generic[HostOrDevice]):
    """One step's inputs: built here on the host (numpy), packed, and read by the jitted step (engine/step.py)."""

    tokens: HostOrDevice  # [T] i32
    meta: AttentionMetadata[HostOrDevice]
    sample_index: HostOrDevice  # [S] i32: index into tokens of each row's last token
    draft_lens: HostOrDevice  # [S] i32: tokens proposed by speculation at the end of each row's chunk (speculative.py)
    lora_rows: HostOrDevice  # [S] i32: each row's LoRA adapter slot, -1 for none (models/lora.py)
    sampling: SamplingBatch[HostOrDevice]
    prompt_targets: HostOrDevice  # [T] i32: the token after each prompt token (for prompt logprobs)
    want_prompt_logprobs: HostOrDevice  # [] bool


class BatchSizes(TypedDict):
    """BatchBuilder's sizes but queries_per_kv: the engine's, which the draft model's builder shares."""

    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    smallest_bucket: int


class BatchBuilder:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        page_size: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        smallest_bucket: int = 16,
        queries_per_kv: int = 1,
        decode_row_buckets: bool = False,
        placement: Sharding | None = None,
    ):
        # where a step's inputs go: tensor parallel, replicated on the mesh (each device copies them from the host;
        # on one device and then across, H200 x2: the second GPU started a 2048-token step 5.1 ms after the first)
        self.placement = placement
        self.S = max_num_seqs
        # steps of few rows and tokens (decodes) run padded to a row bucket, not to max_num_seqs (one program each)
        self.row_buckets = row_buckets(max_num_seqs) if decode_row_buckets else [max_num_seqs]
        self.queries_per_kv = queries_per_kv  # sizes the ragged kernel's query blocks
        self.buckets = token_buckets(max_num_batched_tokens, min(smallest_bucket, max_num_batched_tokens))
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        self.H = max_model_len
        self.V = vocab_size
        self.eos = sorted(eos_token_ids)
        self._no_history: dict[int, jax.Array] = {}  # by rows; stays on device: no per-step copy
        self._all_allowed: dict[int, jax.Array] = {}  # likewise: no grammar
        self.all_allowed = self.allowed_for(self.S)

    def no_history(self, rows: int) -> jax.Array:
        if rows not in self._no_history:
            self._no_history[rows] = put(np.full((rows, self.H), self.V, np.int32), self.placement)
        return self._no_history[rows]

    def allowed_for(self, rows: int) -> jax.Array:
        """Every token allowed for every row: the grammar mask of a batch without grammars, on the device."""
        if rows not in self._all_allowed:
            self._all_allowed[rows] = put(np.full((rows, mask_words(self.V)), -1, np.int32), self.placement)
        return self._all_allowed[rows]

    def bucket_for(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def rows_for(self, num_rows: int) -> int:
        """The row bucket a decode dispatch of num_rows sequences runs at (max_num_seqs without row buckets)."""
        return self.row_buckets[bisect.bisect_left(self.row_buckets, num_rows)]

    def small_step(self, chunks: list[ScheduledChunk]) -> int | None:
        """A step whose rows and tokens both fit a row bucket below max_num_seqs (decodes of a few sequences) runs
        as that many tokens and rows; None: the usual token bucket over max_num_seqs rows."""
        n = max(len(chunks), sum(c.num_step_tokens for c in chunks), 1)
        rows = self.rows_for(n) if n <= self.S else self.S
        return rows if rows < self.S else None

    def build(
        self, chunks: list[ScheduledChunk], bucket: int | None = None, masks: bool = True, rows: int | None = None
    ) -> Packed:
        """bucket forces the padded token count (warm-up compiles each one with an empty batch); masks=False
        leaves the grammar masks to the caller (a decode pipeline computes them while the forward runs); rows:
        the padded row count (a row bucket; default max_num_seqs)."""
        S, V, page = rows or self.S, self.V, self.page_size
        assert len(chunks) <= S, (len(chunks), S)
        T = bucket or self.bucket_for(sum(c.num_step_tokens for c in chunks) or 1)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, INVALID_SLOT, np.int32)
        token_seq = np.zeros(T, np.int32)
        targets = np.zeros(T, np.int32)
        block_tables = np.zeros((S, self.max_pages), np.int32)
        seq_lens = np.zeros(S, np.int32)
        sample_index = np.zeros(S, np.int32)
        draft_lens = np.zeros(S, np.int32)
        lora_rows = np.full(S, -1, np.int32)
        f = {name: np.zeros(S, np.float32) for name in ("temperature", "top_p", "min_p", "presence", "frequency")}
        f["top_p"][:] = 1.0
        repetition = np.ones(S, np.float32)
        top_k = np.zeros(S, np.int32)
        key_data = np.zeros((S, 2), np.uint32)
        sample_pos = np.zeros(S, np.int32)
        bias_ids = np.full((S, MAX_LOGIT_BIAS), V, np.int32)
        bias_values = np.zeros((S, MAX_LOGIT_BIAS), np.float32)
        banned = np.full((S, MAX_BANNED), V, np.int32)
        prompt_lens = np.zeros(S, np.int32)
        history = allowed = None
        constrained = []  # (constraint, row): their masks are computed together, in parallel
        want_prompt = any_filter = want_logprobs = processing = False
        t = 0
        for r, c in enumerate(chunks):
            seq, p = c.seq, c.seq.params
            n, start = c.num_step_tokens, c.start
            pos = np.arange(start, start + n)
            tokens[t : t + n] = seq.token_ids[start : start + c.num_tokens] + c.draft
            draft_lens[r] = len(c.draft)
            lora_rows[r] = seq.lora_slot
            positions[t : t + n] = pos
            pages = np.asarray(seq.pages, np.int32)
            slots[t : t + n] = pages[pos // page] * page + pos % page
            token_seq[t : t + n] = r
            block_tables[r, : len(pages)] = pages
            seq_lens[r] = start + n
            sample_index[r] = t + n - 1
            if p.prompt_logprobs is not None and not seq.prompt_logprobs_done:
                want_prompt = True
                nxt = np.minimum(pos + 1, seq.num_tokens - 1)
                targets[t : t + n] = np.asarray(seq.token_ids)[nxt]
            t += n
            f["temperature"][r] = p.temperature
            f["top_p"][r], f["min_p"][r] = p.top_p, p.min_p
            top_k[r] = max(p.top_k, 0)
            any_filter |= p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
            want_logprobs |= p.logprobs is not None
            processing |= p.temperature > 0.0 or bool(p.logit_bias) or seq.num_output < p.min_tokens
            key_data[r] = row_key_data(seq.seed, seq.index)
            sample_pos[r] = seq.num_tokens
            if p.logit_bias:
                ids = list(p.logit_bias)
                bias_ids[r, : len(ids)] = ids
                bias_values[r, : len(ids)] = [p.logit_bias[i] for i in ids]
            if seq.num_output < p.min_tokens:
                ban = sorted(set(self.eos) | set(p.stop_token_ids or []))[:MAX_BANNED]
                banned[r, : len(ban)] = ban
            if seq.constraint is not None and c.samples and masks:
                constrained.append((seq.constraint, r))
            if p.uses_penalties:
                if history is None:
                    history = np.full((S, self.H), V, np.int32)
                history[r, : seq.num_tokens] = seq.token_ids
                prompt_lens[r] = len(seq.prompt_ids)
                f["presence"][r], f["frequency"][r] = p.presence_penalty, p.frequency_penalty
                repetition[r] = p.repetition_penalty
        if constrained:
            allowed = np.full((S, mask_words(V)), -1, np.int32)
            fill_masks(constrained, allowed)
        blocks = query_blocks(
            [(r, c.start, c.num_step_tokens) for r, c in enumerate(chunks)], T, S, self.queries_per_kv
        )
        meta: AttentionMetadata[HostLeaf] = AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            token_seq=token_seq,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_blocks=blocks,
        )
        sampling: SamplingBatch[HostLeaf] = SamplingBatch(
            temperature=f["temperature"],
            top_k=top_k,
            top_p=f["top_p"],
            min_p=f["min_p"],
            presence_penalty=f["presence"],
            frequency_penalty=f["frequency"],
            repetition_penalty=repetition,
            key_data=key_data,
            position=sample_pos,
            bias_ids=bias_ids,
            bias_values=bias_values,
            banned_ids=banned,
            # history is a device array either way, so the packed layout (and the compiled step) is the same
            history=self.no_history(S) if history is None else put(history, self.placement),
            prompt_lens=prompt_lens,
            allowed=self.allowed_for(S) if allowed is None else put(allowed, self.placement),
            any_constrained=np.asarray(allowed is not None, np.bool_),
            any_penalty=np.asarray(history is not None, np.bool_),
            any_filter=np.asarray(any_filter, np.bool_),
            want_logprobs=np.asarray(want_logprobs, np.bool_),
            plain_greedy=np.asarray(
                not (processing or any_filter or history is not None or allowed is not None), np.bool_
            ),
        )
        inputs: StepInputs[HostLeaf] = StepInputs(
            tokens=tokens,
            meta=meta,
            sample_index=sample_index,
            draft_lens=draft_lens,
            lora_rows=lora_rows,
            sampling=sampling,
            prompt_targets=targets,
            want_prompt_logprobs=np.asarray(want_prompt, np.bool_),
        )
        return pack(
            inputs, self.placement
        )  # a few transfers, and device arrays throughout, so jit sees one signature per bucket
