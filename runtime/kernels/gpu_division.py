"""Division inside Pallas (Triton) kernels rounded as XLA rounds it, for the sampler's kernels that read the raw
logits and divide them by each row's temperature as they load (no scaled copy of the logits written first).

Triton lowers a float32 `/` to PTX's approximate div.full.f32; XLA's divide is IEEE's, rounded to nearest. The
kernels' tokens are the XLA sampler's (sampler.draw_by_candidates: the same thresholds, the same noise), so on
GPUs the division is div.rn.f32 in inline assembly; interpreted (CPU tests), XLA's own division."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

Scale = Callable[[jax.Array, jax.Array], jax.Array]  # (loaded values, the row's temperature) -> the values drawn over


def over(x: jax.Array, t: jax.Array, asm: bool) -> jax.Array:
    """x / t (t broadcast to x's shape), rounded to nearest: by div.rn.f32 where asm, else XLA's division."""
    t = jnp.broadcast_to(t, x.shape)
    if not asm:
        return x / t
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, t],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )[0]


def as_loaded(x: jax.Array, t: jax.Array) -> jax.Array:
    """The logits as loaded: the caller scaled them already."""
    return x


def scaling(temperature: jax.Array | None, interpret: bool) -> Scale:
    """What a kernel applies to the logits it loads: nothing where the caller passes them scaled (no temperature),
    else the division by the row's temperature."""
    return as_loaded if temperature is None else functools.partial(over, asm=not interpret)
