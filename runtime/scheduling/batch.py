"""BatchBuilder: turns the scheduler's chunks into the padded host arrays of one step."""

from __future__ import annotations

import bisect
import functools
import hashlib
from itertools import chain
from typing import Generic, TypedDict

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Sharding

from ..arrays import HostLeaf, HostOrDevice
from ..attention import INVALID_SLOT, AttentionMetadata, query_blocks
from ..limits import MAX_LOGIT_BIAS
from ..parallel.placement import put
from ..sampling.dry import BreakerMasks, DryParams
from ..sampling.grammar import fill_masks, mask_words
from ..sampling.sampler import SamplingBatch
from .packing import Packed, pack
from .scheduler import ScheduledChunk

MAX_BANNED = 48  # eos ids + stop_token_ids banned while below min_tokens
PENDING = -1  # a token id the host does not know yet (Sequence.pending_row): the step still on the device sampled it


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


@functools.lru_cache(maxsize=1 << 16)  # a row's key is asked for at every step it runs
def row_key_data(seed: int, index: int) -> tuple[int, int]:
    """A choice's 64-bit threefry key from its request's seed and its index among the n choices."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


class StepInputs(eqx.Module, Generic[HostOrDevice]):
    """One step's inputs: built here on the host (numpy), packed, and read by the jitted step (engine/step.py)."""

    tokens: HostOrDevice  # [T] i32
    # [T] i32: for a token the host does not know yet (PENDING), its row in `previous`; -1 for the rest
    token_rows: HostOrDevice
    previous: HostOrDevice  # [max_num_seqs] i32 on the device: the samples of the step still running (or zeros)
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
        # the token buckets a step that is not small (small_step: None) can take, more tokens than the second-largest
        # row bucket: only these get asynchronous scheduling's programs (engine.py)
        fewest = self.row_buckets[-2] + 1 if len(self.row_buckets) > 1 else 1
        self.queued_buckets = [t for t in self.buckets if t >= self.bucket_for(fewest)]
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        self.H = max_model_len
        self.V = vocab_size
        self.eos = sorted(eos_token_ids)
        # arrays that are the same every step unless some row asks otherwise (no penalties, no grammar, no bias, no
        # bans), kept on the device by (name, rows): no per-step copy (the bias arrays alone are 600 KB at 256 rows)
        self._constants: dict[tuple[str, int], jax.Array] = {}
        self.all_allowed = self.allowed_for(self.S)
        self.breaker_masks: BreakerMasks | None = (
            None  # DRY's sequence breakers as token masks (the engine's tokenizer)
        )

    def no_previous(self) -> jax.Array:
        """StepInputs.previous of a step that takes no token from another's samples: zeros, on the device as a step's
        samples are, so the packed layout (and the compiled step) is the same either way."""
        if ("previous", 0) not in self._constants:
            self._constants["previous", 0] = put(np.zeros(self.S, np.int32), self.placement)
        return self._constants["previous", 0]

    def _constant(self, name: str, rows: int, width: int, fill, dtype) -> jax.Array:
        if (name, rows) not in self._constants:
            self._constants[name, rows] = put(np.full((rows, width), fill, dtype), self.placement)
        return self._constants[name, rows]

    def no_history(self, rows: int) -> jax.Array:
        return self._constant("history", rows, self.H, self.V, np.int32)

    def allowed_for(self, rows: int) -> jax.Array:
        """Every token allowed for every row: the grammar mask of a batch without grammars, on the device."""
        return self._constant("allowed", rows, mask_words(self.V), -1, np.int32)

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
        self,
        chunks: list[ScheduledChunk],
        bucket: int | None = None,
        masks: bool = True,
        rows: int | None = None,
        previous: jax.Array | None = None,
    ) -> Packed:
        """bucket forces the padded token count (warm-up compiles each one with an empty batch); masks=False
        leaves the grammar masks to the caller (a decode pipeline computes them while the forward runs); rows:
        the padded row count (a row bucket; default max_num_seqs); previous: the [max_num_seqs] tokens of the step
        still on the device, which the PENDING tokens of the chunks' sequences are (asynchronous scheduling)."""
        S, V, page = rows or self.S, self.V, self.page_size
        R = len(chunks)
        assert R <= S, (R, S)
        seqs = [c.seq for c in chunks]
        params = [q.params for q in seqs]
        n = np.fromiter((c.num_step_tokens for c in chunks), np.int64, R)
        live = int(n.sum())
        T = bucket or self.bucket_for(live or 1)
        # each row's values in one numpy call per field (a step has up to 256 rows; per-row numpy calls cost
        # ~20 us a row: benchmarks/host_step.py)
        starts = np.fromiter((c.start for c in chunks), np.int64, R)
        first = np.cumsum(n) - n  # each row's first token in the step
        token_seq = np.zeros(T, np.int32)
        token_seq[:live] = np.repeat(np.arange(R), n)
        positions = np.zeros(T, np.int32)
        positions[:live] = np.arange(live) - np.repeat(first - starts, n)
        tokens = np.zeros(T, np.int32)
        step_tokens = np.fromiter(
            chain.from_iterable(c.seq.token_ids[c.start : c.start + c.num_tokens] + c.draft for c in chunks), np.int32
        )
        if len(step_tokens) != live:
            raise ValueError(f"chunks name {live} tokens, their sequences hold {len(step_tokens)}")
        tokens[:live] = step_tokens
        token_rows = np.full(T, -1, np.int32)
        for r, c in enumerate(chunks if previous is not None else ()):  # a sequence's one PENDING token is its last
            at = c.seq.num_tokens - 1 - c.start
            if c.seq.pending_row is not None and 0 <= at < c.num_tokens:
                token_rows[first[r] + at] = c.seq.pending_row
        if np.any((tokens[:live] == PENDING) & (token_rows[:live] < 0)):
            raise ValueError("a chunk names a token the host has not read, and no step's samples to take it from")
        page_counts = np.fromiter((len(q.pages) for q in seqs), np.int64, R)
        if np.any((n > 0) & ((starts + n - 1) // page >= page_counts)):  # a token past its sequence's pages
            raise ValueError("a chunk's tokens go past its sequence's pages")
        block_tables = np.zeros((S, self.max_pages), np.int32)
        page_rows = np.repeat(np.arange(R), page_counts)
        block_tables[
            page_rows, np.arange(len(page_rows)) - np.repeat(np.cumsum(page_counts) - page_counts, page_counts)
        ] = np.fromiter(chain.from_iterable(q.pages for q in seqs), np.int32, len(page_rows))
        slots = np.full(T, INVALID_SLOT, np.int32)
        pos = positions[:live]
        slots[:live] = block_tables[token_seq[:live], pos // page] * page + pos % page

        def per_row(values, dtype, pad) -> np.ndarray:
            """[S]: the rows' values, then padding rows'."""
            out = np.full(S, pad, dtype)
            out[:R] = values
            return out

        seq_lens = per_row(starts + n, np.int32, 0)
        sample_index = per_row(first + n - 1, np.int32, 0)
        draft_lens = per_row([len(c.draft) for c in chunks], np.int32, 0)
        lora_rows = per_row([q.lora_slot for q in seqs], np.int32, -1)
        temperature = per_row([p.temperature for p in params], np.float32, 0.0)
        top_p = per_row([p.top_p for p in params], np.float32, 1.0)
        min_p = per_row([p.min_p for p in params], np.float32, 0.0)
        top_k = per_row([max(p.top_k, 0) for p in params], np.int32, 0)
        key_data = np.zeros((S, 2), np.uint32)
        key_data[:R] = np.asarray([row_key_data(q.seed, q.index) for q in seqs], np.uint32).reshape(R, 2)
        sample_pos = per_row([q.num_tokens for q in seqs], np.int32, 0)
        presence = np.zeros(S, np.float32)
        frequency = np.zeros(S, np.float32)
        repetition = np.ones(S, np.float32)
        targets = np.zeros(T, np.int32)
        bias: tuple[np.ndarray, np.ndarray] | None = None  # ids and values, made when a row has a bias
        banned: np.ndarray | None = None  # made when a row is below its min_tokens
        prompt_lens = np.zeros(S, np.int32)
        history = allowed = breakers = stop_ids = None
        dry_multiplier, dry_base = np.zeros(S, np.float32), np.ones(S, np.float32)
        dry_allowed, dry_last_n = np.zeros(S, np.int32), np.zeros(S, np.int32)
        constrained = []  # (constraint, row): their masks are computed together, in parallel
        want_prompt = any_filter = want_logprobs = processing = False
        for r, c in enumerate(chunks):  # what only some requests ask for
            seq, p = c.seq, c.seq.params
            any_filter |= p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
            want_logprobs |= p.logprobs is not None
            below_min = seq.num_output < p.min_tokens
            processing |= p.temperature > 0.0 or bool(p.logit_bias) or below_min
            if p.prompt_logprobs is not None and not seq.prompt_logprobs_done:
                want_prompt = True
                t, k = int(first[r]), int(n[r])
                nxt = np.minimum(np.arange(c.start + 1, c.start + 1 + k), seq.num_tokens - 1)
                targets[t : t + k] = np.asarray(seq.token_ids)[nxt]
            if p.logit_bias:
                if bias is None:
                    bias = np.full((S, MAX_LOGIT_BIAS), V, np.int32), np.zeros((S, MAX_LOGIT_BIAS), np.float32)
                ids = list(p.logit_bias)
                bias[0][r, : len(ids)] = ids
                bias[1][r, : len(ids)] = [p.logit_bias[i] for i in ids]
            if below_min:
                if banned is None:
                    banned = np.full((S, MAX_BANNED), V, np.int32)
                ban = sorted(set(self.eos) | set(p.stop_token_ids or []))[:MAX_BANNED]
                banned[r, : len(ban)] = ban
            if seq.constraint is not None and c.samples and masks:
                constrained.append((seq.constraint, r))
            if p.uses_penalties:
                if history is None:
                    history = np.full((S, self.H), V, np.int32)
                history[r, : seq.num_tokens] = seq.token_ids
                prompt_lens[r] = len(seq.prompt_ids)
                presence[r], frequency[r] = p.presence_penalty, p.frequency_penalty
                repetition[r] = p.repetition_penalty
                if stop_ids is None:
                    stop_ids = np.full((S, MAX_BANNED), V, np.int32)
                # the tokens that end this row, which the repetition penalty leaves alone (sampler._apply_penalties);
                # under ignore_eos EOS ends nothing, so it is penalised as any other token
                ends = sorted(set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(self.eos)))[:MAX_BANNED]
                stop_ids[r, : len(ends)] = ends
            if p.uses_dry:
                assert self.breaker_masks is not None, "the engine sets breaker_masks"
                if breakers is None:
                    breakers = np.zeros((S, mask_words(V)), np.int32)
                breakers[r] = self.breaker_masks.words(p.breakers)
                dry_multiplier[r], dry_base[r] = p.dry_multiplier, p.dry_base
                dry_allowed[r], dry_last_n[r] = p.dry_allowed_length, p.dry_penalty_last_n
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

        def on_device(host: np.ndarray | None, name: str, width: int, fill, dtype) -> jax.Array:
            """A device array either way, so the packed layout (and the compiled step) is the same: the rows' values,
            or the constant for none."""
            return self._constant(name, S, width, fill, dtype) if host is None else put(host, self.placement)

        sampling: SamplingBatch[HostLeaf] = SamplingBatch(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            key_data=key_data,
            position=sample_pos,
            bias_ids=on_device(None if bias is None else bias[0], "bias_ids", MAX_LOGIT_BIAS, V, np.int32),
            bias_values=on_device(None if bias is None else bias[1], "bias_values", MAX_LOGIT_BIAS, 0.0, np.float32),
            banned_ids=on_device(banned, "banned", MAX_BANNED, V, np.int32),
            history=on_device(history, "history", self.H, V, np.int32),
            prompt_lens=prompt_lens,
            allowed=on_device(allowed, "allowed", mask_words(V), -1, np.int32),
            any_constrained=np.asarray(allowed is not None, np.bool_),
            any_penalty=np.asarray(history is not None, np.bool_),
            any_filter=np.asarray(any_filter, np.bool_),
            want_logprobs=np.asarray(want_logprobs, np.bool_),
            plain_greedy=np.asarray(
                not (processing or any_filter or history is not None or allowed is not None), np.bool_
            ),
            dry=DryParams(
                multiplier=dry_multiplier,
                base=dry_base,
                allowed_length=dry_allowed,
                last_n=dry_last_n,
                breakers=on_device(breakers, "breakers", mask_words(V), 0, np.int32),
                any_dry=np.asarray(breakers is not None, np.bool_),
            ),
            stop_ids=on_device(stop_ids, "stop_ids", MAX_BANNED, V, np.int32),
        )
        inputs: StepInputs[HostLeaf] = StepInputs(
            tokens=tokens,
            token_rows=token_rows,
            previous=self.no_previous() if previous is None else previous,
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
