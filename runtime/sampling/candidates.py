"""What the candidates draw shares between XLA (sampler.py) and its Pallas kernels (gpu_sampler.py): the block
layout of the candidates, which threefry word each token id's noise is, Gumbel noise from it, and float32 values as
ordered int32 keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK, BLOCKS, DRAWN = 32, 256, 16  # candidates: the values of the 256 blocks of 32 with the largest maxima


def pair_half(vocab: int) -> int:
    """Token ids i and i + pair_half(V) share one threefry2x32 call, its two output words (JAX's original,
    non-partitionable layout of jax.random.gumbel(key, (V,)): the counts split in halves, an odd count padded with a
    0), so a whole row's noise is V / 2 calls, not V (issue 64: the flat rows' noise was at threefry's compute floor)."""
    return (vocab + 1) // 2


def pair_counts(ids: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The threefry counts (x0, x1) whose output holds each id's noise, and whether it is the second word."""
    half = pair_half(vocab)
    second = ids >= half
    x0 = jnp.where(second, ids - half, ids).astype(jnp.uint32)
    x1 = x0 + jnp.uint32(half)
    return x0, jnp.where(x1 < jnp.uint32(vocab), x1, jnp.uint32(0)), second


def gumbel_of_bits(bits: jax.Array) -> jax.Array:
    """Gumbel noise from one threefry2x32 output word, as jax.random.gumbel makes it (gpu_sampler's too)."""
    unit = jax.lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    tiny = jnp.finfo(jnp.float32).tiny
    return -jnp.log(-jnp.log(jnp.maximum(tiny, unit * (1.0 - tiny) + tiny)))


def ordered_keys(x: jax.Array) -> jax.Array:
    """int32 keys in the order of the float32 values (-inf lowest): a float's bits, negatives flipped."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
