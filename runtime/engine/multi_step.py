"""Several decode steps in one dispatch: a lax.scan that feeds each step's sampled tokens to the next.

Used when every scheduled sequence is decoding and nothing needs the host between tokens (no penalties,
min_tokens bans or prompt logprobs). Row r of the batch is token r; a row stops writing K/V after its
`active` steps (its max_tokens or the context ends), and the host discards what it sampled past a stop."""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..attention import INVALID_SLOT, AttentionMetadata
from ..kv.cache import KVCache
from ..models.decoder import DecoderModel
from .packing import Packed
from .sampler import SampleResult, sample
from .step import StepInputs


def run_decode_steps(model: DecoderModel, kv: KVCache, packed: Packed, active: jax.Array,
                     num_steps: int) -> tuple[KVCache, SampleResult]:
    """packed holds one decode token per row (T == S); returns SampleResult with a leading [num_steps] axis."""
    x: StepInputs = packed.unpack()
    meta, page = x.meta, kv.page_size
    rows = jnp.arange(x.tokens.shape[0])

    def one(carry, j):
        kv, tokens = carry
        positions = meta.positions + j
        pages = meta.block_tables[rows, jnp.minimum(positions // page, meta.block_tables.shape[1] - 1)]
        writes = (j < active) & (meta.seq_lens > 0)
        slots = jnp.where(writes, pages * page + positions % page, INVALID_SLOT)
        step_meta = AttentionMetadata(positions=positions, slot_mapping=slots, token_seq=meta.token_seq,
                                      block_tables=meta.block_tables, seq_lens=meta.seq_lens + j, decode=True)
        hidden, kv = model(tokens, step_meta, kv)
        sampling = eqx.tree_at(lambda s: s.position, x.sampling, x.sampling.position + j)
        result = sample(model.logits(hidden).array, sampling)
        return (kv, result.tokens), result

    (kv, _), results = jax.lax.scan(one, (kv, x.tokens), jnp.arange(num_steps))
    return kv, results


decode_steps_fn = jax.jit(run_decode_steps, donate_argnums=(1,), static_argnames=("num_steps",))
