"""The jitted step: one ragged batch of prefill chunks and decode tokens through the model, then sampling.

Shapes are static: T tokens padded to a bucket, S sequence rows padded to max_num_seqs, so XLA compiles one
program per bucket, at warm-up. Logits are computed only at each sampling row's last token, unless some
request asked for prompt logprobs."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from haliax import NamedArray

from ..kv.cache import KVCache
from ..models.decoder import DecoderModel
from ..sampling.sampler import Branches, PromptLogprobs, StepOutputs, sample, top_logprobs
from ..sampling.sampling_params import MAX_LOGPROBS
from ..scheduling.batch import PENDING, StepInputs
from ..scheduling.packing import Packed


def run_step(
    model: DecoderModel, kv: KVCache, packed: Packed, branches: Branches | None = None
) -> tuple[KVCache, StepOutputs]:
    """branches: the sampling branches decided on the host, for a step without prompt logprobs (an asynchronous
    step's program: no lax.cond, whose predicate XLA:GPU copies to the host, so its call returns at once and the
    host builds the next step while this one runs); None: each is a lax.cond on the batch's flags."""
    x: StepInputs[jax.Array] = packed.unpack()
    # the tokens the host has not read yet are the samples of the step before, still on the device
    tokens = jnp.where(x.token_rows >= 0, x.previous[jnp.maximum(x.token_rows, 0)], x.tokens)
    hidden, kv = model(tokens, x.meta, kv, x.lora_rows)
    if branches is not None and branches.any_penalty:  # an asynchronous step's rows with penalties (engine.py)
        x = eqx.tree_at(lambda x: x.sampling.history, x, _history_read(x, tokens))
    return kv, step_outputs(model, hidden, x, branches)


def _history_read(x: StepInputs[jax.Array], tokens: jax.Array) -> jax.Array:
    """The penalties' histories [S, H] with each row's PENDING token (its last, which this step computes) replaced
    by the token the step before sampled: the one at the row's sample index, read from `previous` above. A row
    whose PENDING token this step does not reach samples nothing; its entry becomes an id the counts drop."""
    history = x.sampling.history
    read = x.token_rows[x.sample_index] >= 0  # the row's last token in this step was PENDING
    token = jnp.where(read, tokens[x.sample_index], jnp.iinfo(jnp.int32).max)
    return jnp.where(history == PENDING, token[:, None], history)


def step_outputs(
    model: DecoderModel, hidden: NamedArray, x: StepInputs[jax.Array], branches: Branches | None = None
) -> StepOutputs:
    """The step's samples (and prompt logprobs, when asked) from the model's hidden states [token, Embed]."""
    last = hidden["token", x.sample_index]  # [S, Embed] (the axis keeps its name)
    logits = model.logits(last).array
    sampled = sample(logits, x.sampling, branches)
    T = x.tokens.shape[0]

    def prompt_logprobs(h):
        lp = jax.nn.log_softmax(model.logits(h).array, axis=-1)
        chosen = jnp.take_along_axis(lp, x.prompt_targets[:, None], axis=-1)[:, 0]
        top_lp, top_ids = top_logprobs(lp)
        rank = (1 + jnp.sum(lp > chosen[:, None], axis=-1)).astype(jnp.int32)
        return PromptLogprobs(chosen, rank, top_ids.astype(jnp.int32), top_lp)

    def none(h):
        return PromptLogprobs(
            jnp.zeros((T,), jnp.float32),
            jnp.ones((T,), jnp.int32),
            jnp.zeros((T, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((T, MAX_LOGPROBS), jnp.float32),
        )

    prompt = (
        none(hidden) if branches is not None else jax.lax.cond(x.want_prompt_logprobs, prompt_logprobs, none, hidden)
    )
    return StepOutputs(sampled, prompt)


# The KV cache is donated: XLA updates the pages in place instead of copying the pool every step.
step_fn = jax.jit(run_step, donate_argnums=(1,), static_argnames=("branches",))
