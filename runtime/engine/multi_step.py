"""Several decode steps in one engine step, when every scheduled sequence is decoding and nothing needs the host
between tokens (no min_tokens bans or prompt logprobs). Penalties run inside: the scan carries what they read
(each row's token counts, PenaltyCounts, and for DRY its last DRY_WINDOW tokens) and adds every step's samples to it, and a run's next dispatch takes
the counts its last one left.

Free batches run as one dispatch: a lax.scan that feeds each step's sampled tokens to the next. Batches with
structured outputs need each constrained row's next mask from its last token, so they run as a pipeline of
two dispatches a step: the forward of step j is queued first, and while the device runs it the host reads
step j-1's tokens, advances the grammars and computes step j's masks, then queues step j's sampling. Row r of
the batch is token r; a row stops writing K/V after its `active` steps (its max_tokens or the context ends),
and the host discards what it sampled past a stop.

A free batch's run goes on past its first dispatch while no waiting request could take a row: before the host
reads a dispatch's tokens it queues the next one (the same rows, steps offset by num_steps, the first tokens taken
on the device from the last step's samples), so the device decodes while the host applies tokens, checks stops
and builds outputs. The next engine step takes that dispatch's results (`continue_run`). A row that stops early
(EOS, a stop string, an abort) is found one dispatch late: its next dispatch computes tokens the host drops, into
pages it still held when that dispatch was queued (programs run in queue order, so the pages' next owner writes
after it)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..attention import INVALID_SLOT, AttentionMetadata
from ..kv.cache import KVCache
from ..limits import DRY_WINDOW
from ..models.decoder import HALVES_COMPILER_OPTIONS, HALVES_MIN_ROWS, DecoderModel
from ..parallel.mesh import model_parallel_size
from ..parallel.placement import put
from ..parallel.vocab_greedy import greedy_from_vocab_shards
from ..sampling.grammar import fill_masks, mask_words
from ..sampling.programs import SCAN_BRANCHES, carries_counts, scan_branches, scans
from ..sampling.sampler import (
    Branches,
    PenaltyCounts,
    SampleResult,
    SamplingBatch,
    count_sampled,
    is_plain_greedy,
    penalty_counts,
    plain_greedy_result,
    sample,
)
from ..scheduling.batch import StepInputs
from ..scheduling.packing import Packed
from ..scheduling.scheduler import ScheduledChunk
from .engine_state import EngineState
from .outputs import RequestOutput
from .warmup import Program


def _forward(
    model: DecoderModel,
    kv: KVCache,
    x: StepInputs,
    tokens: jax.Array,
    active: jax.Array,
    j: jax.Array,
    gather: bool = True,
) -> tuple[jax.Array, KVCache]:
    """Step j of a decode run: each row's token at its position + j; returns the rows' logits [S, V] (gather=False:
    left split by vocabulary under tensor parallelism, see DecoderModel.logits)."""
    meta, page = x.meta, kv.page_size
    rows = jnp.arange(x.tokens.shape[0])
    positions = meta.positions + j
    pages = meta.block_tables[rows, jnp.minimum(positions // page, meta.block_tables.shape[1] - 1)]
    writes = (j < active) & (meta.seq_lens > 0)
    slots = jnp.where(writes, pages * page + positions % page, INVALID_SLOT)
    # a row past its last step (its max_tokens, or found stopped) reads no K/V either: attention skips empty rows
    step_meta = AttentionMetadata(
        positions=positions,
        slot_mapping=slots,
        token_seq=meta.token_seq,
        block_tables=meta.block_tables,
        seq_lens=jnp.where(writes, meta.seq_lens + j, 0),
        decode=True,
    )
    hidden, kv = model(tokens, step_meta, kv, x.lora_rows)
    return model.logits(hidden, gather).array, kv


def _at_step(sampling: SamplingBatch[jax.Array], j: jax.Array) -> SamplingBatch[jax.Array]:
    return eqx.tree_at(lambda s: s.position, sampling, sampling.position + j)  # each step draws with its own key


def run_decode_steps(
    model: DecoderModel,
    kv: KVCache,
    packed: Packed,
    active: jax.Array,
    offset: jax.Array,
    previous: jax.Array,
    block_tables: jax.Array,
    counts: PenaltyCounts | None,
    num_steps: int,
    branches: Branches = SCAN_BRANCHES,
) -> tuple[KVCache, SampleResult, PenaltyCounts | None]:
    """Steps offset .. offset + num_steps - 1 of a run; packed holds one decode token per row (T == S), the first
    step's tokens at offset 0, else previous[-1] (the dispatch before's last samples, [num_steps, S]); block_tables
    [S, pages] the rows' pages so far; counts (when carries_counts(branches)) the penalties' counts the dispatch
    before left, counted from the packed history instead at offset 0. Returns SampleResult with a leading
    [num_steps] axis, and the counts after the last step."""
    x: StepInputs[jax.Array] = packed.unpack()
    x = eqx.tree_at(lambda x: x.meta.block_tables, x, block_tables)
    if counts is not None:
        start = penalty_counts(x.sampling, model.cfg.vocab_size)
        counts = jax.tree.map(lambda a, b: jnp.where(offset == 0, a, b), start, counts)

    # a plain greedy run split over devices picks from each device's vocabulary shard (gathering no logits)
    split_greedy = is_plain_greedy(branches) and model_parallel_size() > 1

    def one(carry, j):
        kv, tokens, counts = carry
        logits, kv = _forward(model, kv, x, tokens, active, j, gather=not split_greedy)
        if split_greedy:
            result = plain_greedy_result(*greedy_from_vocab_shards(logits, model.cfg.vocab_size))
        else:
            result = sample(logits, _at_step(x.sampling, j), branches, counts)
        if counts is not None:  # the sampled token joins each row's output before the next step samples
            counts = count_sampled(counts, result.tokens)
        return (kv, result.tokens, counts), result

    first = jnp.where(offset == 0, x.tokens, previous[-1])
    (kv, _, counts), results = jax.lax.scan(one, (kv, first, counts), offset + jnp.arange(num_steps))
    return kv, results, counts


def run_decode_forward(
    model: DecoderModel, kv: KVCache, packed: Packed, previous: jax.Array, active: jax.Array, j: jax.Array
) -> tuple[KVCache, jax.Array]:
    """The pipeline's forward of step j: the packed tokens at j == 0, then the previous step's samples."""
    x: StepInputs[jax.Array] = packed.unpack()
    logits, kv = _forward(model, kv, x, jnp.where(j == 0, x.tokens, previous), active, j)
    return kv, logits


def run_decode_sample(
    logits: jax.Array, packed: Packed, allowed: jax.Array, j: jax.Array, branches: Branches
) -> SampleResult:
    """The pipeline's sampling of step j with this step's grammar masks; its branches are static, so queueing it
    never waits for the device (see Branches)."""
    x: StepInputs[jax.Array] = packed.unpack()
    sampling = eqx.tree_at(lambda s: s.allowed, _at_step(x.sampling, j), allowed)
    return sample(logits, sampling, branches)


def pipeline_branches(*, all_greedy: bool, any_filter: bool, want_logprobs: bool) -> Branches:
    """The sampling branches of a grammar batch (penalties never run multi-step); greedy rows ignore filters."""
    return Branches(
        plain_greedy=False,
        any_constrained=True,
        any_penalty=False,
        any_filter=any_filter and not all_greedy,
        all_greedy=all_greedy,
        want_logprobs=want_logprobs,
    )


PIPELINE_BRANCHES = sorted(
    {
        pipeline_branches(all_greedy=g, any_filter=f, want_logprobs=w)
        for g in (False, True)
        for f in (False, True)
        for w in (False, True)
    }
)


_OPTIONS = HALVES_COMPILER_OPTIONS if HALVES_MIN_ROWS else None  # the halves kept apart (models/decoder.py)
decode_steps_fn = jax.jit(
    run_decode_steps, donate_argnums=(1,), static_argnames=("num_steps", "branches"), compiler_options=_OPTIONS
)
decode_forward_fn = jax.jit(run_decode_forward, donate_argnums=(1,), compiler_options=_OPTIONS)
decode_sample_fn = jax.jit(run_decode_sample, static_argnames=("branches",))


@dataclasses.dataclass
class Dispatch:
    """One dispatch of a free batch's run: steps offset .. offset + num_steps - 1 from each row's chunk start."""

    chunks: list[ScheduledChunk]  # row r is chunks[r]; c.start is the row's position at the run's first step
    inputs: Packed
    limits: list[int]  # the most steps each row may take in the run (its max_tokens, the context's end)
    offset: int
    num_steps: int  # steps a dispatch of its run takes (MultiStepDecoder.steps_for)
    active: np.ndarray  # [S] each row writes K/V for its steps below this (its limit, or where it was found stopped)
    branches: Branches  # its program (scan_branches)
    out: SampleResult | None = None  # on the device
    counts: PenaltyCounts | None = None  # on the device: the penalties' counts after its last step (carries_counts)
    future: Future | None = None  # the call, while it runs on the dispatch thread


class MultiStepDecoder:
    """The engine's multi-step decoding (host side): whether a step can take several decode steps, and running
    them (one scan, or the two-dispatch pipeline for grammars). It works on the engine's own state (its KV cache,
    scheduler and requests), as the Speculator does, and appends tokens through the engine's token path."""

    def __init__(self, engine: EngineState):
        self.engine = engine
        self.ahead: Dispatch | None = None  # queued before the last step returned: the next step applies it
        # a call returns only once the device is nearly done with it (XLA:GPU reads each lax.cond's predicate back
        # to the host), so the next dispatch is queued from this thread while the engine's applies tokens
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="capstan-dispatch")
        self._zero_counts: dict[int, PenaltyCounts] = {}  # by rows (_no_counts)
        self.stored: dict[tuple, jax.stages.Compiled] = {}  # a scan's program key -> the program the store gave

    def warmup(self, model: DecoderModel) -> None:
        """Compiles the scan and the pipeline's programs (its forward and every sampling branch set) for model (one
        of the engine's variants: LLMEngine.model_for)."""
        e = self.engine
        with e._precision():
            for S in e.builder.row_buckets:  # a free batch's scan runs at its row bucket
                inputs = e.builder.build([], bucket=S, rows=S)
                for k, branches in itertools.product(self.step_counts(S), scans(jax.default_backend())):
                    active, offset, tables = self._placed(np.zeros(S, np.int32), np.int32(0), self._block_tables([], S))
                    e.kv, out, _ = decode_steps_fn(
                        model,
                        e.kv,
                        inputs,
                        active,
                        offset,
                        self._no_previous(S, k),
                        tables,
                        self._no_counts(S, branches),
                        num_steps=k,
                        branches=branches,
                    )
                    jax.block_until_ready(out)
            # the grammar pipeline runs at max_num_seqs rows
            inputs = e.builder.build([], bucket=e.builder.S)
            e.kv, logits = decode_forward_fn(model, e.kv, inputs, out.tokens[0], out.tokens[0], np.int32(0))
            for branches in PIPELINE_BRANCHES:
                jax.block_until_ready(
                    decode_sample_fn(logits, inputs, e.builder.all_allowed, np.int32(0), branches=branches)
                )

    def _program_key(self, chunks: list[ScheduledChunk], k: int, grammars: bool) -> tuple:
        """The key of the program decode() would run for these chunks (as programs() names it)."""
        variant = self.engine.variant_of(chunks)
        if grammars:
            return ("pipeline", variant)
        branches = scan_branches([c.seq.params for c in chunks], jax.default_backend())
        return ("scan", variant, self.engine.builder.rows_for(len(chunks)), k, branches)

    def programs(self, variants: dict[str, Callable[[], DecoderModel]]) -> tuple[list[Program], list[Program]]:
        """What warmup() compiles, for serve's background warm-up (engine/warmup.py): the scans of the smallest row
        bucket (one stream's decoding), then every other row bucket's and the grammar pipeline. Arguments are made
        here, on the engine's thread, as a call makes them."""
        e = self.engine
        near: list[Program] = []
        far: list[Program] = []
        for S in e.builder.row_buckets:
            inputs = e.builder.build([], bucket=S, rows=S)
            for k, branches in itertools.product(self.step_counts(S), reversed(scans(jax.default_backend()))):
                active, offset, tables = self._placed(np.zeros(S, np.int32), np.int32(0), self._block_tables([], S))
                args = (inputs, active, offset, self._no_previous(S, k), tables, self._no_counts(S, branches))
                for name, model in variants.items():
                    program = self._scan_program(("scan", name, S, k, branches), model, args)
                    (near if e.builder.row_buckets[0] == S else far).append(program)
        inputs = e.builder.build([], bucket=e.builder.S)
        previous = put(np.zeros(e.builder.S, np.int32), e.parallel.inputs_sharding())
        for name, model in variants.items():
            far.append(Program(("pipeline", name), functools.partial(self._lower_pipeline, model, inputs, previous)))
        return near, far

    def _scan_program(self, key: tuple, model: Callable[[], DecoderModel], args: tuple) -> Program:
        """A scan's program, loaded from the engine's program store when it has it, else compiled and kept there."""
        e, (_, _, _, k, branches) = self.engine, key
        lower = lambda: [decode_steps_fn.lower(model(), e._kv, *args, num_steps=k, branches=branches)]  # noqa: E731
        store = e.program_store
        if store is None:
            return Program(key, lower)

        def load() -> bool:
            compiled = store.load(key, (model(), e._kv, *args))
            if compiled is not None:
                self.stored[key] = compiled
            return compiled is not None

        return Program(key, lower, load, lambda compiled: store.save(key, (model(), e._kv, *args), compiled[0]))

    def _scan(self, chunks: list[ScheduledChunk], rows: int, k: int, branches: Branches) -> Callable:
        """What runs a free batch's dispatch: the program the store gave for its key, else the jitted scan."""
        stored = self.stored.get(("scan", self.engine.variant_of(chunks), rows, k, branches)) if self.stored else None
        return stored if stored is not None else functools.partial(decode_steps_fn, num_steps=k, branches=branches)

    def _lower_pipeline(self, model: Callable[[], DecoderModel], inputs: Packed, previous: jax.Array) -> list:
        e = self.engine
        forward = decode_forward_fn.lower(model(), e._kv, inputs, previous, previous, np.int32(0))
        logits = forward.out_info[1]
        logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype)  # uncommitted, as the forward's output is
        samples = [
            decode_sample_fn.lower(logits, inputs, e.builder.all_allowed, np.int32(0), branches=branches)
            for branches in PIPELINE_BRANCHES
        ]
        return [forward, *samples]

    def steps_for(self, rows: int) -> int:
        """Steps a dispatch of `rows` sequences takes: decode_steps for a full batch, fewer while rows are free, so
        a request arriving meanwhile is admitted after at most two such dispatches (the one under way and the one
        queued behind it) rather than two of decode_steps."""
        e = self.engine
        return e.config.decode_steps if rows >= e.builder.S else e.config.steps_with_room()

    def step_counts(self, bucket: int) -> list[int]:
        """The step counts a free batch's scan runs with at this row bucket (each compiled at warm-up)."""
        e = self.engine
        counts = {e.config.decode_steps} if bucket >= e.builder.S else set()
        if e.builder.S > 1:  # a batch of fewer rows than max_num_seqs fits every bucket
            counts.add(e.config.steps_with_room())
        return sorted(counts)

    def plan(self, chunks: list[ScheduledChunk]) -> list[int] | None:
        """Steps each row may take in one multi-step dispatch, or None when this step must be a single one."""
        e = self.engine
        k = self.steps_for(len(chunks))
        # admit waiting requests first; a sequence whose pages come back from the host tier is written at the next
        # step's poll, so single steps until then (a 16-step run made it wait a whole run: ~60 ms on the 1B shape)
        if k <= 1 or (e.scheduler.admissible_waiting() or e.scheduler.loading) and len(chunks) < e.builder.S:
            return None
        # the grammar pipeline applies no penalties: a batch with both takes single steps
        grammars = any(c.seq.constraint is not None for c in chunks)
        for c in chunks:
            p = c.seq.params
            if (
                not (c.num_tokens == 1 and c.samples)
                or c.seq.max_tokens == 0
                or c.seq.pending_forks
                or p.uses_penalties
                and grammars
                or c.seq.num_output < p.min_tokens
                or p.prompt_logprobs is not None
                and not c.seq.prompt_logprobs_done
            ):
                return None
        if e.warming is not None and not e.compiled(self._program_key(chunks, k, grammars)):  # still compiling
            return None  # single steps meanwhile
        active = [
            max(1, min(k, c.seq.max_tokens - c.seq.num_output, e.max_model_len - c.seq.num_tokens)) for c in chunks
        ]
        for c, n in zip(chunks, active, strict=True):
            if not e.scheduler.reserve_ahead(c.seq, n):
                return None
        return active

    def decode(self, chunks: list[ScheduledChunk], active: list[int]) -> list[RequestOutput]:
        """Runs the planned steps (row r takes active[r]) and applies each row's tokens up to its stop."""
        e = self.engine
        k = self.steps_for(len(chunks))  # as plan() chose
        steps = {id(c.seq): n for c, n in zip(chunks, active, strict=True)}
        constrained = any(c.seq.constraint is not None for c in chunks)
        S = e.builder.S if constrained else e.builder.rows_for(len(chunks))  # a free batch: its row bucket
        chunks, inputs = e._build(chunks, bucket=S, masks=not constrained, rows=S)
        if not chunks:
            return []
        active = [steps[id(c.seq)] for c in chunks]
        rows = np.zeros(S, np.int32)
        rows[: len(active)] = active
        if not constrained:
            limits = [
                max(1, min(c.seq.max_tokens - c.seq.num_output, e.max_model_len - c.seq.num_tokens)) for c in chunks
            ]
            d = Dispatch(
                chunks,
                inputs,
                limits,
                0,
                k,
                rows,
                scan_branches([c.seq.params for c in chunks], jax.default_backend()),
            )
            placed_rows, offset, tables = self._placed(rows, np.int32(0), self._block_tables(chunks, S))
            scan = self._scan(chunks, S, k, d.branches)
            with e._precision():
                e.kv, d.out, d.counts = scan(
                    e.model_for(chunks),
                    e.kv,
                    inputs,
                    placed_rows,
                    offset,
                    self._no_previous(S, k),
                    tables,
                    self._no_counts(S, d.branches),
                )
            return self._apply(d)
        grammar_end: dict[int, int] = {}  # row -> the step whose token completed its grammar
        refused: dict[int, BaseException] = {}  # row -> why its grammar refused a token
        out = self._pipeline(chunks, active, k, inputs, rows, grammar_end, refused)
        tokens = out.tokens.tolist()  # [step][row]: plain ints, so the per-token loop stays cheap
        for r, c in enumerate(chunks):
            seq = c.seq
            if seq.request_id not in e.requests:
                continue
            try:
                if r in refused:
                    raise refused[r]
                seq.num_computed = c.start + active[r]
                for j in range(active[r]):
                    if seq.finished:
                        break
                    done = None if seq.constraint is None else grammar_end.get(r) == j  # accepted in the pipeline
                    e._append_token(seq, tokens[j][r], out, (j, r), grammar_done=done)
                if not seq.finished:
                    e.scheduler.register_full_pages(seq)
            except Exception as err:  # noqa: BLE001 - this request's own fault
                e.fail(seq.request_id, err)
        return e._collect_all(c.seq.request_id for c in chunks)

    def continue_run(self) -> list[RequestOutput]:
        """The engine step after a dispatch was queued ahead: apply its tokens (queueing the next first)."""
        d, self.ahead = self.ahead, None
        assert d is not None, "called when a dispatch was queued ahead"
        self.settle(d)
        return self._apply(d)

    def settle(self, d: Dispatch | None = None) -> None:
        """Waits for the queued dispatch's call to return; the engine's KV cache is its output from then on."""
        d = d or self.ahead
        if d is not None and d.future is not None:
            future, d.future = d.future, None
            # re-raises the call's error: a device fault stops the engine
            self.engine._kv, d.out, d.counts = future.result()

    def _apply(self, d: Dispatch) -> list[RequestOutput]:
        """Queues the run's next dispatch when it can go on, then applies this one's tokens."""
        e = self.engine
        self.ahead = self._queue_next(d)
        out = e.fetch(d.out)
        tokens = out.tokens.tolist()  # [step][row]: plain ints, so the per-token loop stays cheap
        k = d.num_steps
        for r, c in enumerate(d.chunks):
            seq = c.seq
            if seq.request_id not in e.requests or seq.finished:
                continue  # stopped in an earlier dispatch, or aborted: what it computed since is dropped
            try:
                end = min(d.limits[r], d.offset + k)
                seq.num_computed = c.start + end
                for j in range(d.offset, end):
                    e._append_token(seq, tokens[j - d.offset][r], out, (j - d.offset, r))
                    if seq.finished:
                        break
                if not seq.finished:
                    e.scheduler.register_full_pages(seq)
            except Exception as err:  # noqa: BLE001 - this request's own fault
                e.fail(seq.request_id, err)
        return e._collect_all(c.seq.request_id for c in d.chunks)

    def _queue_next(self, d: Dispatch) -> Dispatch | None:
        """The run's next dispatch, queued on the dispatch thread, when some row goes on past d, no speculation would
        propose, and no waiting request could take a row; None when the run ends with d (the next step schedules
        afresh)."""
        e = self.engine
        k = d.num_steps
        offset = d.offset + k
        live = [r for r, c in enumerate(d.chunks) if c.seq.request_id in e.requests and not c.seq.finished]
        # speculation proposes at every engine step (unless the batch is too large for it): a run queued ahead would
        # skip its proposals
        if e.speculator is not None and e.speculator.active() or not any(d.limits[r] > offset for r in live):
            return None
        # a waiting request is admitted as soon as a row frees: the run goes on only while every row stays (a row
        # ending on EOS or a stop string is found a dispatch late, as vLLM's async scheduling finds it a step late)
        if e.scheduler.waiting and (len(live) < e.builder.S or any(d.limits[r] <= offset for r in live)):
            return None
        if e.scheduler.offload is not None and e.scheduler.offload.landed:  # restored pages wait to be written
            return None
        if e.builder.rows_for(len(live)) < len(d.active):  # the rows left fit a smaller row bucket: schedule afresh
            return None
        active = np.minimum(d.active, offset)  # rows found stopped write nothing more
        for r in live:
            c = d.chunks[r]
            steps = min(d.limits[r], offset + k)
            if not e.scheduler.reserve_ahead(c.seq, c.start + steps - c.seq.num_computed):
                return None  # no pages for it: the next step schedules afresh (it may preempt)
            active[r] = steps
        nxt = Dispatch(d.chunks, d.inputs, d.limits, offset, k, active, d.branches)
        assert d.out is not None, "d is settled before the next dispatch is queued"
        kv, previous, counts = e.kv, d.out.tokens, d.counts
        placed_active, placed_offset, tables = self._placed(
            active, np.int32(offset), self._block_tables(d.chunks, len(d.active))
        )
        model = e.model_for(d.chunks)  # the run's variant: its rows' adapters stay in their slots while it runs
        scan = self._scan(d.chunks, len(d.active), k, d.branches)

        def call():
            with e._precision():
                return scan(model, kv, d.inputs, placed_active, placed_offset, previous, tables, counts)

        nxt.future = self._thread.submit(call)
        return nxt

    def _no_previous(self, rows: int, num_steps: int) -> np.ndarray | jax.Array:
        """Zeros for a run's first dispatch in place of the previous one's tokens, placed as those are (replicated on
        the tensor-parallel mesh): an unplaced array there made the queued dispatches a second program, compiled in
        the middle of the first run (8B shape, TP=2: 8 s of a 10 s decode phase); on one device a numpy array did the
        same (a dispatch queued ahead takes device arrays)."""
        zeros = np.zeros((num_steps, rows), np.int32)
        return put(zeros, self._outputs_sharding())

    def _placed(self, *arrays: np.ndarray | np.generic) -> list[jax.Array]:
        """A dispatch's small host arguments (rows' step counts, offset, block tables) on the device in one call, placed
        as its outputs are. Put from the dispatch thread, each numpy argument waited ~5 ms for the GIL that the main
        thread held applying tokens (Python's switch interval): in a profiled TP=2 run the GPU idled 20.9 ms before
        a dispatch's first kernel (H200 x2, 8B shape; untraced runs did not change: benchmarks/RESULTS.md)."""
        return put(list(arrays), self._outputs_sharding())

    def _outputs_sharding(self):
        """Where a dispatch's outputs are: replicated on the mesh; on one device, committed to it when the cache is
        (the host tier commits it), else uncommitted (None). Zeros placed otherwise made a run's later dispatches a
        second program, compiled mid-serving (host tier, H100: one step of 2.2 s on the 1B shape, 4.5 s on the 8B)."""
        e = self.engine
        sharding = e.parallel.inputs_sharding()
        if sharding is None and e._kv.k[0].committed:
            return e._kv.k[0].sharding
        return sharding

    def _no_counts(self, rows: int, branches: Branches) -> PenaltyCounts | None:
        """A run's first dispatch's counts argument (the scan counts the packed history itself there), placed as a
        later dispatch's are; None for a program without penalties. Kept on the device: the argument is not
        donated."""
        if not carries_counts(branches):
            return None
        if rows not in self._zero_counts:
            V, sharding = self.engine.model.cfg.vocab_size, self._outputs_sharding()
            output, seen = np.zeros((rows, V), np.float32), np.zeros((rows, V), np.bool_)
            recent = np.full((rows, DRY_WINDOW), V, np.int32)  # DRY's window: the builder always gives DryParams
            # placed as _no_previous places its zeros
            self._zero_counts[rows] = PenaltyCounts(*put([output, seen, recent], sharding))
        return self._zero_counts[rows]

    def _block_tables(self, chunks: list[ScheduledChunk], rows: int) -> np.ndarray:
        e = self.engine
        tables = np.zeros((rows, e.builder.max_pages), np.int32)
        for r, c in enumerate(chunks):
            tables[r, : len(c.seq.pages)] = c.seq.pages
        return tables

    def _pipeline(
        self,
        chunks: list[ScheduledChunk],
        active: list[int],
        num_steps: int,
        inputs,
        rows: np.ndarray,
        grammar_end: dict[int, int],
        refused: dict[int, BaseException],
    ) -> SampleResult:
        """The decode steps of a batch with grammars, two dispatches a step: while the device runs step j's
        forward, the host advances each grammar by its step j-1 token and computes its step j mask. Returns the
        steps' samples on the host ([step, row] leading axes) and fills grammar_end and refused."""
        e = self.engine
        model = e.model_for(chunks)
        grammars = [(c.seq.constraint, r) for r, c in enumerate(chunks) if c.seq.constraint is not None]
        words = mask_words(e.model.cfg.vocab_size)
        active_rows = put(rows, e.parallel.inputs_sharding())
        params = [c.seq.params for c in chunks]
        branches = pipeline_branches(
            all_greedy=all(p.temperature == 0.0 for p in params),
            any_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params),
            want_logprobs=any(p.logprobs is not None for p in params),
        )
        results: list[SampleResult] = []
        previous = active_rows  # any [S] i32 array: step 0 reads the packed tokens instead

        def advance(j: int) -> None:
            """Each live grammar takes its row's token of step j."""
            tokens = np.asarray(results[j].tokens)
            for constraint, r in grammars:
                if j < active[r] and r not in grammar_end and r not in refused:
                    try:
                        if constraint.accept(int(tokens[r])):
                            grammar_end[r] = j
                    except Exception as err:  # noqa: BLE001 - this request's own fault, failed when applied
                        refused[r] = err

        with e._precision():
            for j in range(num_steps):
                e.kv, logits = decode_forward_fn(model, e.kv, inputs, previous, active_rows, np.int32(j))
                if j:
                    advance(j - 1)  # the forward above is queued: this host work overlaps it
                live = [(c, r) for c, r in grammars if j < active[r] and r not in grammar_end and r not in refused]
                allowed = np.full((e.builder.S, words), -1, np.int32)  # fresh: the last one may still be in flight
                if live:
                    fill_masks(live, allowed)
                results.append(
                    decode_sample_fn(
                        logits,
                        inputs,
                        put(allowed, e.parallel.inputs_sharding()),
                        np.int32(j),
                        branches=branches,
                    )
                )
                previous = results[-1].tokens
        advance(num_steps - 1)
        host = e.fetch(results)
        return jax.tree.map(lambda *steps: np.stack(steps), *host)
