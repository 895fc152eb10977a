"""Speculative decoding by n-gram prompt lookup: a decoding sequence proposes the K tokens that followed the last
occurrence of its own latest n-gram (in its prompt or output), and one target step verifies them: the proposal is
computed as a short prefill chunk, and the step samples the next token after every proposed position.

Verification is coupled to the engine's sampling: the token at position p is drawn with the key (seed, p), with or
without speculation, so a proposed token is accepted exactly when it is the token the target would have drawn
there. The first mismatch is replaced by the target's own token, and the output is token for token the output of
decoding without speculation (greedy and seeded alike): the target's distribution, exactly. For a proposal that
is a single token (n-gram lookup proposes one token per position with certainty), this accepts it with the
target's probability of it, as rejection sampling does."""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..kv.cache import KVCache
from ..models.decoder import DecoderModel
from .packing import Packed
from .sampler import SampleResult, sample
from .step import StepInputs

def propose_ngram(tokens: list[int], k: int, longest: int, shortest: int) -> list[int]:
    """k tokens following the latest earlier occurrence of tokens' last n-gram (longest n first): what followed
    it, and as the text since then repeats it, that again; none when no n-gram recurs."""
    if k <= 0 or len(tokens) <= shortest:
        return []
    ids = np.asarray(tokens, np.int64)
    for n in range(min(longest, len(ids) - 1), shortest - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every earlier n-gram but the last
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            period = len(ids) - start  # the text since that occurrence, assumed to repeat
            return ids[start + np.arange(k) % period].tolist()
    return []


def run_verify(model: DecoderModel, kv: KVCache, packed: Packed, num_positions: int) -> tuple[KVCache, SampleResult]:
    """One step whose rows sample after each of their last num_positions tokens (a row with d proposed tokens
    uses d + 1 of them; the rest repeat its last). Returns SampleResult with leading [S, num_positions] axes."""
    x: StepInputs = packed.unpack()
    hidden, kv = model(x.tokens, x.meta, kv)
    S, K1 = x.sample_index.shape[0], num_positions
    steps = jnp.minimum(jnp.arange(K1)[None, :], x.draft_lens[:, None])  # [S, K1]: 0..d, then d again
    index = x.sample_index[:, None] - x.draft_lens[:, None] + steps
    logits = model.logits(hidden["token", index.reshape(-1)]).array
    rows = jax.tree.map(lambda a: jnp.repeat(a, K1, axis=0) if a.ndim else a, x.sampling)
    # the draw for each position uses that position's key, as decoding without speculation does
    rows = eqx.tree_at(lambda s: s.position, rows, rows.position + steps.reshape(-1))
    result = sample(logits, rows)
    return kv, jax.tree.map(lambda a: a.reshape(S, K1, *a.shape[1:]), result)


verify_fn = jax.jit(run_verify, donate_argnums=(1,), static_argnames=("num_positions",))
