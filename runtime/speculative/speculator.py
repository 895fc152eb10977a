"""Speculator: speculative decoding for the engine. Each step, the decoding sequences that can take them get proposed
tokens, by n-gram prompt lookup or from a draft model (draft_model.py); one target step verifies them all. With
n-gram lookup, a decoding sequence proposes the K tokens that followed the last occurrence of its own latest
n-gram (in its prompt or output). Verification computes each proposal as a short prefill chunk and samples the
next token after every proposed position.

Verification is coupled to the engine's sampling: the token at position p is drawn with the key (seed, p), with or
without speculation, so a proposed token is accepted exactly when it is the token the target would have drawn
there. The first mismatch is replaced by the target's own token, and the output is token for token the output of
decoding without speculation (greedy and seeded alike): the target's distribution, exactly. For a proposal that
is a single token (n-gram lookup proposes one token per position with certainty), this accepts it with the
target's probability of it, as rejection sampling does."""

from __future__ import annotations

from array import array
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..kv.cache import KVCache
from ..models.decoder import DecoderModel
from ..sampling.programs import GREEDY_SCAN, SAMPLED_SCANS, scan_branches
from ..sampling.sampler import Branches, SampleResult, StepOutputs, sample
from ..scheduling.batch import BatchBuilder, BatchSizes, StepInputs
from ..scheduling.packing import Packed
from ..scheduling.scheduler import ScheduledChunk
from ..speculative_config import SpeculativeConfig
from .draft_model import DraftModel


def propose_ngram(tokens: list[int], k: int, longest: int, shortest: int) -> list[int]:
    """k tokens following the latest earlier occurrence of tokens' last n-gram (longest n first): what followed
    it, and as the text since then repeats it, that again; none when no n-gram recurs. The search is bytes.rfind
    over the tokens' int32 bytes (C speed: a batch of rows proposes in well under a millisecond)."""
    if k <= 0 or len(tokens) <= shortest:
        return []
    data, L = array("i", tokens).tobytes(), len(tokens)
    for n in range(min(longest, L - 1), shortest - 1, -1):
        pattern, end = data[-4 * n :], 4 * (L - 1)  # every earlier n-gram but the last
        while (i := data.rfind(pattern, 0, end)) >= 0:
            if i % 4 == 0:  # a whole-token match
                start = i // 4 + n
                period = L - start  # the text since that occurrence, assumed to repeat
                return [tokens[start + j % period] for j in range(k)]
            end = i + 4 * n - 1  # a match straddling tokens: look further back
    return []


# On GPUs a verify step's sampling branches are decided on the host, as the decode scan's are (multi_step.py): a
# plain greedy batch, a sampled one, and one that takes every processor (grammar masks, penalties and bans applied
# to all rows are exact for rows without them, and logprobs), so no lax.cond waits on the device. CPUs keep one
# traced program.
VERIFY_GENERAL = Branches(
    plain_greedy=False, any_constrained=True, any_penalty=True, any_filter=True, all_greedy=False, want_logprobs=True
)


def verify_programs(backend: str) -> tuple[Branches | None, ...]:
    return (GREEDY_SCAN, SAMPLED_SCANS[False], VERIFY_GENERAL) if backend == "gpu" else (None,)


def verify_branches(chunks: list[ScheduledChunk], backend: str) -> Branches | None:
    """The verify program for a step of these chunks (verify_programs)."""
    if backend != "gpu":
        return None
    if any(
        c.seq.constraint is not None
        or c.seq.params.uses_penalties
        or c.seq.num_output < c.seq.params.min_tokens
        or c.seq.params.logprobs is not None
        for c in chunks
    ):
        return VERIFY_GENERAL
    return scan_branches([c.seq.params for c in chunks], backend)


def verify_points(seq_lens: jax.Array, draft_lens: jax.Array, num_points: int) -> tuple[jax.Array, jax.Array]:
    """The step's sampling points, row by row: row r (a real row: seq_lens > 0) samples after its last token and
    each of its draft_lens[r] proposed ones. Returns (row, step) [num_points], step 0 .. draft_lens[row]; points past
    the last are row S - 1's step 0 (drawn, never read)."""
    counts = jnp.where(seq_lens > 0, draft_lens + 1, 0)
    ends = jnp.cumsum(counts)
    q = jnp.arange(num_points)
    row = jnp.minimum(jnp.searchsorted(ends, q, side="right"), seq_lens.shape[0] - 1)
    step = jnp.where(q < ends[-1], q - (ends[row] - counts[row]), 0)
    return row, step


def point_bases(chunks: list[ScheduledChunk]) -> list[int]:
    """Each chunk's first sampling point (verify_points' order, on the host)."""
    return np.cumsum([0] + [len(c.draft) + 1 for c in chunks[:-1]]).tolist()


def run_verify(
    model: DecoderModel,
    kv: KVCache,
    packed: Packed,
    proposals: jax.Array,
    draft_at: jax.Array,
    draft_row: jax.Array,
    num_positions: int,
    branches: Branches | None = None,
) -> tuple[KVCache, tuple[SampleResult, jax.Array]]:
    """One step whose rows sample after their last token and each proposed one (a row with d proposed tokens at
    most num_positions - 1 takes d + 1 points). A draft model's proposals [K, S] come as the device left them:
    row r's d tokens go to the step's tokens from index draft_at[r] (-1: its proposals are in the packed tokens
    already, as n-gram lookup's are), taken from proposals' column draft_row[r]. Logits are computed at the points
    only: min(tokens, rows x num_positions) of them, so a small batch's verify projects a few rows onto the
    vocabulary, not every padded row's K + 1. Returns (SampleResult with a leading [points] axis, point_bases
    giving each row's first; the proposals, for the host)."""
    x: StepInputs[jax.Array] = packed.unpack()
    j = jnp.arange(proposals.shape[0])[:, None]
    fill = (draft_at[None, :] >= 0) & (j < x.draft_lens[None, :])
    at = jnp.where(fill, draft_at[None, :] + j, x.tokens.shape[0])  # out of range: dropped
    tokens = x.tokens.at[at.reshape(-1)].set(proposals[j, draft_row[None, :]].reshape(-1), mode="drop")
    hidden, kv = model(tokens, x.meta, kv, x.lora_rows)
    num_points = min(x.tokens.shape[0], x.sample_index.shape[0] * num_positions)
    row, step = verify_points(x.meta.seq_lens, x.draft_lens, num_points)
    index = x.sample_index[row] - x.draft_lens[row] + step
    logits = model.logits(hidden["token", index]).array
    rows = jax.tree.map(lambda a: a[row] if a.ndim else a, x.sampling)
    # the draw at each point uses that position's key, as decoding without speculation does
    rows = eqx.tree_at(lambda s: s.position, rows, rows.position + step)
    return kv, (sample(logits, rows, branches), proposals)


verify_fn = jax.jit(run_verify, donate_argnums=(1,), static_argnames=("num_positions", "branches"))


class Speculator:
    """The engine's speculative decoding: proposes tokens for a step's decoding rows, then verifies them in one
    target step. It works on the engine's own state (its KV cache, pool, scheduler and requests), as the Embedder
    does, and applies accepted tokens through the engine's token path so stops and logprobs stay the engine's."""

    def __init__(self, engine, config: SpeculativeConfig, draft_model: DecoderModel | None, rows: BatchSizes):
        """draft_model: loaded and placed already (method draft_model), the engine's pages sized for it too;
        rows: the target's BatchBuilder arguments, which the draft's steps share."""
        self.engine, self.k = engine, config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.draft: DraftModel | None = None  # with a draft model: its cache over the engine's pages
        # n-gram lookup: (tokens, at most k) -> proposal; tests and benchmarks set oracles here
        self.proposer: Callable[[list[int], int], list[int]] | None = None
        if draft_model is not None:
            d, c = draft_model.cfg, engine.config
            self.draft = DraftModel(
                draft_model,
                BatchBuilder(**rows, queries_per_kv=d.queries_per_kv, placement=engine.parallel.inputs_sharding()),
                KVCache.allocate(
                    d.num_layers,
                    c.num_pages,
                    c.page_size,
                    d.num_kv_heads,
                    d.head_dim,
                    engine.kv_dtype,
                    sharding=engine.parallel.kv_sharding(),
                ),
                self.k,
            )
        else:
            self.proposer = lambda tokens, k: propose_ngram(
                tokens, k, config.prompt_lookup_max, config.prompt_lookup_min
            )
        self.proposals: jax.Array | None = None  # the draft's last proposals, on the device
        S = engine.builder.S  # verify_fn's proposal arguments for steps whose proposals are in the packed tokens
        self.no_device_proposals = tuple(
            jax.device_put([np.zeros((self.k, S), np.int32), np.full(S, -1, np.int32), np.zeros(S, np.int32)])
        )
        self.columns: dict[int, int] = {}  # id(chunk) -> its proposals' column there
        self.draft_tokens = 0  # tokens proposed (EngineStats.spec_draft_tokens)
        self.accepted_tokens = 0  # of those, the ones the target verified (EngineStats.spec_accepted_tokens)
        self.drafts = 0  # rows verified with proposals (EngineStats.spec_drafts)
        self.accepted_per_pos = [0] * self.k  # accepted proposals by their position in the proposal

    def warmup(self, models) -> None:
        """Compiles the verify step of every token bucket for each of the engine's model variants (LLMEngine.model_for),
        and the draft's programs."""
        engine = self.engine
        for model, bucket in ((m, b) for m in models for b in engine.builder.buckets):
            for branches in verify_programs(jax.default_backend()):
                with engine._precision():
                    engine.kv, out = verify_fn(
                        model,
                        engine.kv,
                        engine.builder.build([], bucket=bucket),
                        *self.no_device_proposals,
                        num_positions=self.k + 1,
                        branches=branches,
                    )
                jax.block_until_ready(out)
        if self.draft is not None:
            with engine._precision():
                self.draft.warmup()

    def active(self) -> bool:
        """Whether steps propose now: not while disable_by_batch_size or more sequences are running."""
        size = self.disable_by_batch_size
        return size is None or len(self.engine.scheduler.running) < size

    def propose(self, chunks: list[ScheduledChunk], budget: int) -> bool:
        """Proposes tokens for the decoding sequences that can take them, within budget tokens (n-gram lookup or the
        draft model); True if any got some. Sequences whose sampling needs the host between tokens (penalties,
        min_tokens bans, grammars) and steps with prompt logprobs are left to plain decoding."""
        self.proposals, self.columns = None, {}
        if any(c.seq.params.prompt_logprobs is not None and not c.seq.prompt_logprobs_done for c in chunks):
            return False
        scheduler = self.engine.scheduler
        if self.draft is not None:
            takers, rooms = [], []
            for c in chunks:
                if (room := self._room(c, budget)) > 0:
                    takers.append(c)
                    rooms.append(room)
                    budget -= room
            with self.engine._precision():
                self.proposals, counts = self.draft.propose([c.seq for c in takers], rooms, scheduler.reserve_ahead)
            for column, (c, n) in enumerate(zip(takers, counts, strict=True)):
                if n:  # placeholders: the verify step takes the tokens from the device (run_verify)
                    c.draft, self.columns[id(c)] = [0] * n, column
            return any(counts)
        assert self.proposer is not None  # no draft model: the n-gram lookup (or a test's oracle)
        for c in chunks:
            room = self._room(c, budget)
            draft = self.proposer(c.seq.token_ids, room) if room > 0 else []
            if draft and scheduler.reserve_ahead(c.seq, 1 + len(draft)):
                c.draft = draft
                budget -= len(draft)
        return any(c.draft for c in chunks)

    def _room(self, c: ScheduledChunk, budget: int) -> int:
        """How many tokens c's sequence may have proposed this step (0: none, it decodes plainly)."""
        seq, p = c.seq, c.seq.params
        if (
            not (c.num_tokens == 1 and c.samples)
            or seq.constraint is not None
            or p.uses_penalties
            or seq.pending_forks
            or seq.num_output < p.min_tokens
            or seq.max_tokens == 0
        ):
            return 0
        return min(self.k, budget, seq.max_tokens - seq.num_output - 1, self.engine.max_model_len - seq.num_tokens - 1)

    def verify(self, chunks: list[ScheduledChunk]) -> list[str]:
        """One step that computes each proposal as a short chunk and samples after every proposed token; a row
        keeps its proposed tokens up to the first the target would not have drawn, then the target's own token.
        The pages reserved for rejected tokens go back to the pool. Returns the requests it stepped (the engine
        collects their outputs)."""
        engine = self.engine
        columns, self.columns = self.columns, {}
        proposals, self.proposals = self.proposals, None
        chunks, inputs = engine._build(chunks)
        if not chunks:
            return []
        if columns:  # a draft model's: where each row's go in the step's tokens, and which column they are
            S = engine.builder.S
            draft_at, draft_row = np.full(S, -1, np.int32), np.zeros(S, np.int32)
            t = 0
            for r, c in enumerate(chunks):
                if id(c) in columns:
                    draft_at[r], draft_row[r] = t + c.num_tokens, columns[id(c)]
                t += c.num_step_tokens
        else:
            proposals, draft_at, draft_row = self.no_device_proposals
        with engine._precision():
            engine.kv, out = verify_fn(
                engine.model_for(chunks),
                engine.kv,
                inputs,
                proposals,
                draft_at,
                draft_row,
                num_positions=self.k + 1,
                branches=verify_branches(chunks, jax.default_backend()),
            )
        out, proposals = engine.fetch(out)
        for c in chunks:
            if id(c) in columns:
                c.draft = proposals[: len(c.draft), columns[id(c)]].tolist()
        tokens = out.tokens.tolist()  # [point]
        bases = point_bases(chunks)
        first = StepOutputs(sampled=jax.tree.map(lambda a: a[bases], out), prompt=None)
        first_tokens = first.sampled.tokens.tolist()
        page = engine.config.page_size
        for r, c in enumerate(chunks):
            seq = c.seq
            if seq.request_id not in engine.requests:
                continue
            try:
                if not c.draft:
                    engine._apply_chunk(c, r, 0, first, first.sampled, first_tokens[r])
                    continue
                accepted = 0
                base = bases[r]
                while accepted < len(c.draft) and c.draft[accepted] == tokens[base + accepted]:
                    accepted += 1
                self.draft_tokens += len(c.draft)
                self.accepted_tokens += accepted
                self.drafts += 1
                for i in range(accepted):
                    self.accepted_per_pos[i] += 1
                seq.num_computed = c.start + 1 + accepted  # the accepted tokens' K/V are written
                seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed)  # not a rejected token's
                for i in range(accepted + 1):  # the accepted ones, then the target's own next token
                    if seq.finished:
                        break
                    engine._append_token(seq, tokens[base + i], out, base + i)
                if not seq.finished:
                    keep = -(-(seq.num_computed + 1) // page)  # through the next token's page
                    engine.pool.release(seq.pages[keep:])
                    del seq.pages[keep:]
                    engine.scheduler.register_full_pages(seq)
            except Exception as e:  # noqa: BLE001 - this request's own fault
                engine.fail(seq.request_id, e)
        return [c.seq.request_id for c in chunks]
