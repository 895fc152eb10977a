"""DraftModel: a smaller model with the target's vocabulary that proposes K tokens a step for speculative decoding.

Its KV cache has the target's pages (same page size and count, its own layers and heads), so a sequence's page
table serves both models and the scheduler's allocation covers the draft too. The draft catches up lazily: a
step first runs it over the tokens of each sequence it has not seen (a ragged chunk, [num_draft_computed, len)),
samples the first proposal after them, then takes K-1 single-token decode steps, all in one dispatch; the
proposals stay on the device for the verify step queued behind it (speculative.run_verify). Every
proposal is sampled by the target's sampler with the target's rows and position keys (seed, position), so a
draft identical to the target proposes exactly the tokens the target draws, and verification (speculative.py)
stays lossless whatever the draft proposes: its quality only changes how many are accepted."""

from __future__ import annotations

import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..attention import INVALID_SLOT, AttentionMetadata
from ..kv.cache import KVCache
from ..models.checkpoint_path import resolve_checkpoint
from ..models.config import UnsupportedModelError
from ..models.decoder import DecoderModel
from ..models.loader import load_model
from ..parallel.tensor_parallel import TensorParallel, check_size
from ..sampling.programs import GREEDY_SCAN, SAMPLED_SCANS, scan_branches
from ..sampling.sampler import Branches, sample
from ..scheduling.batch import BatchBuilder, StepInputs
from ..scheduling.packing import Packed
from ..scheduling.scheduler import ScheduledChunk
from ..scheduling.sequence import Sequence

log = logging.getLogger("capstan.engine")


def load_draft(
    name: str, target: DecoderModel, dtype: str, parallel: TensorParallel, given: DecoderModel | None = None
) -> DecoderModel:
    """The draft checkpoint `name` (or the model given), checked against the target and placed as it is.
    Proposals are token ids drawn with the target's sampler: the vocabularies must be the same."""
    try:
        draft = given if given is not None else load_model(resolve_checkpoint(name), dtype)
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise UnsupportedModelError(
                f"vocab_size {draft.cfg.vocab_size} differs from the target's "
                f"{target.cfg.vocab_size}; a draft model needs the target's vocabulary"
            )
        check_size(draft.cfg, parallel.size, len(jax.devices()))
    except ValueError as e:  # say which flag names the checkpoint at fault (the loader may have named it already)
        raise UnsupportedModelError(
            f"--speculative-config: model {name}: {str(e).removeprefix(f'model {name}: ')}"
        ) from None
    return parallel.place_model(draft)


def draft_programs(backend: str) -> tuple[Branches | None, ...]:
    """The draft's sampling programs: on GPUs decided on the host (greedy, sampled; proposals need no logprobs),
    as the decode scan's are (multi_step.py); CPUs keep one traced program."""
    return (GREEDY_SCAN, SAMPLED_SCANS[False]) if backend == "gpu" else (None,)


def draft_branches(seqs: list[Sequence], backend: str) -> Branches | None:
    """The program for proposals to these sequences (the speculator drafts no grammar, penalty or ban rows)."""
    if backend != "gpu":
        return None
    return GREEDY_SCAN if scan_branches([s.params for s in seqs], backend) is GREEDY_SCAN else SAMPLED_SCANS[False]


def run_draft(
    model: DecoderModel, kv: KVCache, packed: Packed, steps: jax.Array, num_steps: int, branches: Branches | None = None
) -> tuple[KVCache, jax.Array]:
    """packed: each row's catch-up chunk, ending at its last token; steps [S]: the tokens row r proposes (0: it only
    catches up). Returns the proposals [num_steps, S]: step 0 samples after the chunk, step j feeds step j-1's."""
    x: StepInputs[jax.Array] = packed.unpack()
    draws = eqx.tree_at(lambda s: s.want_logprobs, x.sampling, jnp.zeros((), jnp.bool_))  # tokens, no logprobs
    hidden, kv = model(x.tokens, x.meta, kv)
    first = sample(model.logits(hidden["token", x.sample_index]).array, draws, branches).tokens
    meta, page = x.meta, kv.page_size
    S = steps.shape[0]
    rows = jnp.arange(S)

    def one(carry, j):
        kv, tokens = carry
        positions = x.sampling.position + j - 1  # where the token fed now sits
        pages = meta.block_tables[rows, jnp.minimum(positions // page, meta.block_tables.shape[1] - 1)]
        # past a row's proposals its pages may not be reserved: it writes nothing there
        slots = jnp.where(j < steps, pages * page + positions % page, INVALID_SLOT)
        step_meta = AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            token_seq=rows,
            block_tables=meta.block_tables,
            seq_lens=positions + 1,
            decode=True,
        )
        h, kv = model(tokens, step_meta, kv)
        sampling = eqx.tree_at(lambda s: s.position, draws, x.sampling.position + j)  # that position's key
        drawn = sample(model.logits(h).array, sampling, branches).tokens
        return (kv, drawn), drawn

    (kv, _), rest = jax.lax.scan(one, (kv, first), jnp.arange(1, num_steps))
    return kv, jnp.concatenate([first[None], rest], axis=0)


draft_fn = jax.jit(run_draft, donate_argnums=(1,), static_argnames=("num_steps", "branches"))


class DraftModel:
    def __init__(self, model: DecoderModel, builder: BatchBuilder, kv: KVCache, num_speculative_tokens: int):
        """builder: the target's rows and token buckets, with the draft's queries_per_kv; kv: the draft's cache
        over the target's pages."""
        self.model, self.builder, self.kv = model, builder, kv
        self.k = num_speculative_tokens

    def warmup(self) -> None:
        for bucket in self.builder.buckets:
            for branches in draft_programs(jax.default_backend()):
                self.kv, out = draft_fn(
                    self.model,
                    self.kv,
                    self.builder.build([], bucket=bucket),
                    np.zeros(self.builder.S, np.int32),
                    num_steps=self.k,
                    branches=branches,
                )
                jax.block_until_ready(out)

    def propose(self, seqs: list[Sequence], rooms: list[int], reserve) -> tuple[jax.Array | None, list[int]]:
        """Catches the draft up on each sequence's unseen tokens and proposes up to rooms[i] tokens for it, once its
        pages for them are reserved (reserve(seq, n) -> bool: pages for n tokens from seq.num_computed). A sequence
        further behind than the step's token budget catches up partly and proposes nothing this step. Returns the
        proposals on the device ([K, S]: seqs[i]'s in column i), left there for the verify step that follows them
        in the device's queue (the host builds that step meanwhile), and how many of seqs[i]'s count."""
        budget = self.builder.buckets[-1]
        chunks, steps = [], []
        for seq, room in zip(seqs, rooms, strict=True):
            behind = seq.num_tokens - seq.num_draft_computed
            assert behind >= 1, "the target computes each sequence's last token in this step: the draft has not"
            n = min(behind, budget)
            if n == 0:
                break
            budget -= n
            chunks.append(ScheduledChunk(seq, seq.num_draft_computed, n))
            steps.append(room if n == behind and room > 0 and reserve(seq, 1 + room) else 0)
        counts = steps + [0] * (len(seqs) - len(steps))
        if not chunks:
            return None, counts
        try:
            inputs = self.builder.build(chunks)
        except Exception:  # noqa: BLE001 - a request's bad input: no proposals; the target's step isolates it
            log.exception("building the draft's step failed; decoding without proposals")
            return None, [0] * len(seqs)
        rows = np.zeros(self.builder.S, np.int32)
        rows[: len(steps)] = steps
        self.kv, proposals = draft_fn(
            self.model,
            self.kv,
            inputs,
            rows,
            num_steps=self.k,
            branches=draft_branches([c.seq for c in chunks], jax.default_backend()),
        )
        for c, n in zip(chunks, steps, strict=True):
            # the draft K/V of its proposals but the last are written too; verification keeps those it accepts
            c.seq.num_draft_computed = c.start + c.num_tokens + max(n - 1, 0)
        return proposals, counts
