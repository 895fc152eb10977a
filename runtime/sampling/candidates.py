"""What the candidates draw shares between XLA (sampler.py) and its Pallas kernels (gpu_sampler.py): the block
layout of the candidates, Gumbel noise from threefry's bits, and float32 values as ordered int32 keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK, BLOCKS, DRAWN = 32, 256, 16  # candidates: the values of the 256 blocks of 32 with the largest maxima


def gumbel_of_bits(b1: jax.Array, b2: jax.Array) -> jax.Array:
    """Gumbel noise from threefry2x32's two output words, as jax.random.gumbel makes it (gpu_sampler's too)."""
    unit = jax.lax.bitcast_convert_type(((b1 ^ b2) >> jnp.uint32(9)) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    tiny = jnp.finfo(jnp.float32).tiny
    return -jnp.log(-jnp.log(jnp.maximum(tiny, unit * (1.0 - tiny) + tiny)))


def ordered_keys(x: jax.Array) -> jax.Array:
    """int32 keys in the order of the float32 values (-inf lowest): a float's bits, negatives flipped."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
