"""Greedy picks from logits left split by vocabulary (tensor parallelism): each device takes its shard's argmax and
log-sum-exp, and only those [S] values cross the devices, not the [S, Vocab] float32 logits (8B shape, 256 rows:
131 MB gathered onto each GPU every decode step, then one argmax repeated whole on every GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .mesh import MODEL_AXIS


def greedy_from_vocab_shards(logits: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """logits [S, V] float32, V split along the model axis (and padded past vocab_size, see tensor_parallel.py) ->
    each row's argmax token [S] int32 and its log-probability [S]: the tokens jnp.argmax over the whole row gives
    (its first maximum: the lowest shard holding the maximum, then the lowest index in it)."""

    def per_shard(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        shard = x.shape[-1]
        first = jax.lax.axis_index(MODEL_AXIS) * shard
        x = jnp.where(first + jnp.arange(shard) < vocab_size, x, -jnp.inf)  # the padded rows are no tokens
        i = jnp.argmax(x, axis=-1)
        best = jnp.take_along_axis(x, i[:, None], axis=-1)[:, 0]
        lse = jax.nn.logsumexp(x, axis=-1)
        maxima, ids, lses = (jax.lax.all_gather(a, MODEL_AXIS) for a in (best, first + i, lse))  # [N, S] each
        winner = jnp.argmax(maxima, axis=0)[None, :]  # the first shard with the row's maximum
        top = jnp.take_along_axis(maxima, winner, axis=0)[0]
        token = jnp.take_along_axis(ids, winner, axis=0)[0].astype(jnp.int32)
        return token, top - jax.nn.logsumexp(lses, axis=0)

    return jax.shard_map(per_shard, in_specs=P(None, MODEL_AXIS), out_specs=(P(), P()), check_vma=False)(logits)
