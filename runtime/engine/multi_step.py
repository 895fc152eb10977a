"""Several decode steps in one engine step, when every scheduled sequence is decoding and nothing needs the host
between tokens (no penalties, min_tokens bans or prompt logprobs).

Free batches run as one dispatch: a lax.scan that feeds each step's sampled tokens to the next. Batches with
structured outputs need each constrained row's next mask from its last token, so they run as a pipeline of
two dispatches a step: the forward of step j is queued first, and while the device runs it the host reads
step j-1's tokens, advances the grammars and computes step j's masks, then queues step j's sampling. Row r of
the batch is token r; a row stops writing K/V after its `active` steps (its max_tokens or the context ends),
and the host discards what it sampled past a stop."""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..attention import INVALID_SLOT, AttentionMetadata
from ..kv.cache import KVCache
from ..models.decoder import DecoderModel
from .packing import Packed
from .sampler import Branches, SampleResult, SamplingBatch, sample
from .step import StepInputs


def _forward(model: DecoderModel, kv: KVCache, x: StepInputs, tokens: jax.Array, active: jax.Array,
             j: jax.Array) -> tuple[jax.Array, KVCache]:
    """Step j of a decode run: each row's token at its position + j; returns the rows' logits [S, V]."""
    meta, page = x.meta, kv.page_size
    rows = jnp.arange(x.tokens.shape[0])
    positions = meta.positions + j
    pages = meta.block_tables[rows, jnp.minimum(positions // page, meta.block_tables.shape[1] - 1)]
    writes = (j < active) & (meta.seq_lens > 0)
    slots = jnp.where(writes, pages * page + positions % page, INVALID_SLOT)
    step_meta = AttentionMetadata(positions=positions, slot_mapping=slots, token_seq=meta.token_seq,
                                  block_tables=meta.block_tables, seq_lens=meta.seq_lens + j, decode=True)
    hidden, kv = model(tokens, step_meta, kv)
    return model.logits(hidden).array, kv


def _at_step(sampling: SamplingBatch, j: jax.Array) -> SamplingBatch:
    return eqx.tree_at(lambda s: s.position, sampling, sampling.position + j)  # each step draws with its own key


def run_decode_steps(model: DecoderModel, kv: KVCache, packed: Packed, active: jax.Array,
                     num_steps: int) -> tuple[KVCache, SampleResult]:
    """packed holds one decode token per row (T == S); returns SampleResult with a leading [num_steps] axis."""
    x: StepInputs = packed.unpack()

    def one(carry, j):
        kv, tokens = carry
        logits, kv = _forward(model, kv, x, tokens, active, j)
        result = sample(logits, _at_step(x.sampling, j))
        return (kv, result.tokens), result

    (kv, _), results = jax.lax.scan(one, (kv, x.tokens), jnp.arange(num_steps))
    return kv, results


def run_decode_forward(model: DecoderModel, kv: KVCache, packed: Packed, previous: jax.Array, active: jax.Array,
                       j: jax.Array) -> tuple[KVCache, jax.Array]:
    """The pipeline's forward of step j: the packed tokens at j == 0, then the previous step's samples."""
    x: StepInputs = packed.unpack()
    logits, kv = _forward(model, kv, x, jnp.where(j == 0, x.tokens, previous), active, j)
    return kv, logits


def run_decode_sample(logits: jax.Array, packed: Packed, allowed: jax.Array, j: jax.Array,
                      branches: Branches) -> SampleResult:
    """The pipeline's sampling of step j with this step's grammar masks; its branches are static, so queueing it
    never waits for the device (see Branches)."""
    x: StepInputs = packed.unpack()
    sampling = eqx.tree_at(lambda s: s.allowed, _at_step(x.sampling, j), allowed)
    return sample(logits, sampling, branches)


def pipeline_branches(*, all_greedy: bool, any_filter: bool, want_logprobs: bool) -> Branches:
    """The sampling branches of a grammar batch (penalties never run multi-step); greedy rows ignore filters."""
    return Branches(plain_greedy=False, any_constrained=True, any_penalty=False,
                    any_filter=any_filter and not all_greedy, all_greedy=all_greedy, want_logprobs=want_logprobs)


PIPELINE_BRANCHES = sorted({pipeline_branches(all_greedy=g, any_filter=f, want_logprobs=w)
                            for g in (False, True) for f in (False, True) for w in (False, True)})


decode_steps_fn = jax.jit(run_decode_steps, donate_argnums=(1,), static_argnames=("num_steps",))
decode_forward_fn = jax.jit(run_decode_forward, donate_argnums=(1,))
decode_sample_fn = jax.jit(run_decode_sample, static_argnames=("branches",))
