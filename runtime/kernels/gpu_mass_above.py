"""The candidates draw's mass test on NVIDIA GPUs: one Pallas (Triton) pass over each row for all its drawn values.

draw_by_candidates asks, for each of a row's DRAWN best perturbed values, the probability mass strictly above it
(is the token inside top-p?). As XLA writes it (sampler.mass_above) that is one reduction over the row per value,
16 reads of 256 x 128,256 float32 logits (0.31 ms of the GPU sampler's 1.62 on an H100, benchmarks/RESULTS.md).
Here programs read the row once, each a part of it in chunks, and add each value's terms from registers; XLA sums
the parts. Rows not asked for read nothing (gpu_sampler asks only for rows whose top-p is still open)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .gpu_division import Scale, scaling

CHUNK = 2048  # values a program takes at a time
CHUNKS_PER_PROGRAM = 4  # a row's programs: one alone was latency-bound (0.16 ms for 85 rows of 128,256 on an H100)
TUNING = (8, 3)  # num_warps, num_stages: a first choice
if os.environ.get("CAPSTAN_MASS_ABOVE_TUNING"):  # "num_warps,num_stages,chunks_per_program": a sweep's knob
    _warps, _stages, CHUNKS_PER_PROGRAM = map(int, os.environ["CAPSTAN_MASS_ABOVE_TUNING"].split(","))
    TUNING = (_warps, _stages)


def _kernel(x_ref, row_ref, values_ref, out_ref, *, vocab: int, chunk: int, per_program: int, scale: Scale):
    cut, top = row_ref[0], row_ref[1]
    values = values_ref[...]  # [D]
    first = pl.program_id(1) * per_program  # interpreted kernels read program ids only outside conditions

    @pl.when(row_ref[2] == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    @pl.when(row_ref[2] != 0)
    def _():
        lanes = jnp.arange(chunk)

        def add(i, acc):  # chunk first + i; the row's last is its last `chunk` values, less those before it took
            start = jnp.minimum((first + i) * chunk, vocab - chunk)
            x = scale(x_ref[pl.ds(start, chunk)], row_ref[3])  # (divided by the temperature where unscaled)
            valid = start + lanes >= (first + i) * chunk
            w = jnp.where(valid & (x >= cut), jnp.exp(x - top), 0.0)  # the kept set's unnormalised probabilities
            return acc + jnp.sum(jnp.where(x[None, :] > values[:, None], w[None, :], 0.0), axis=1)

        n = jnp.minimum(per_program, -(-vocab // chunk) - first)
        out_ref[...] = jax.lax.fori_loop(0, n, add, jnp.zeros(values.shape, jnp.float32))


def mass_above(
    x: jax.Array,
    cut: jax.Array,
    top: jax.Array,
    values: jax.Array,
    *,
    rows: jax.Array | None = None,
    interpret: bool = False,
    temperature: jax.Array | None = None,
) -> jax.Array:
    """[S, D]: per row of x [S, V], the sum of exp(x - top) over x >= cut and x > each of its D values [S, D] (D a
    power of two); sampler.mass_above with weights where(x >= cut, exp(x - top), 0). rows [S] bool: the rows to
    sum (others read nothing and give 0); all by default. temperature [S]: x unscaled, the sums those of
    x / temperature (divided as loaded)."""
    S, V = x.shape
    D = values.shape[1]
    chunk = min(CHUNK, 1 << (V.bit_length() - 1))  # a power of two no longer than the row
    chunks = -(-V // chunk)
    programs = -(-chunks // CHUNKS_PER_PROGRAM)
    warps, stages = TUNING
    wanted = jnp.ones((S,), jnp.float32) if rows is None else rows.astype(jnp.float32)
    parts = pl.pallas_call(
        functools.partial(
            _kernel,
            vocab=V,
            chunk=chunk,
            per_program=CHUNKS_PER_PROGRAM,
            scale=scaling(temperature, interpret),
        ),
        grid=(S, programs),
        in_specs=[
            pl.BlockSpec((None, V), lambda s, p: (s, 0)),
            pl.BlockSpec((None, 4), lambda s, p: (s, 0)),
            pl.BlockSpec((None, D), lambda s, p: (s, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, D), lambda s, p: (s, p, 0)),
        out_shape=jax.ShapeDtypeStruct((S, programs, D), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="mass_above",
    )(
        x.astype(jnp.float32),
        jnp.stack([cut, top, wanted, wanted if temperature is None else temperature], axis=1).astype(jnp.float32),
        values.astype(jnp.float32),
    )
    return jnp.sum(parts, axis=1)
