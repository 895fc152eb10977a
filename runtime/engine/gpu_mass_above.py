"""The candidates draw's mass test on NVIDIA GPUs: one Pallas (Triton) pass over each row for all its drawn values.

draw_by_candidates asks, for each of a row's DRAWN best perturbed values, the probability mass strictly above it
(is the token inside top-p?). As XLA writes it (sampler.mass_above) that is one reduction over the row per value,
16 reads of 256 x 128,256 float32 logits (0.31 ms of the GPU sampler's 1.62 on an H100, benchmarks/RESULTS.md).
Here a program per row reads the row once, in chunks, and adds each value's terms from registers."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

CHUNK = 2048  # values a program takes at a time
TUNING = (8, 3)  # num_warps, num_stages: a first choice


def _kernel(x_ref, row_ref, values_ref, out_ref, *, vocab: int, chunk: int):
    cut, top = row_ref[0], row_ref[1]

    @pl.when(row_ref[2] == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    @pl.when(row_ref[2] != 0)
    def _():
        _sum_above(x_ref, cut, top, values_ref[...], out_ref, vocab=vocab, chunk=chunk)


def _sum_above(x_ref, cut, top, values, out_ref, *, vocab: int, chunk: int):
    def add(x, valid, acc):
        w = jnp.where(valid & (x >= cut), jnp.exp(x - top), 0.0)  # the kept set's unnormalised probabilities
        return acc + jnp.sum(jnp.where(x[None, :] > values[:, None], w[None, :], 0.0), axis=1)

    out_ref[...] = row_chunks(x_ref, vocab, chunk, add, jnp.zeros(values.shape, jnp.float32))


def row_chunks(x_ref, vocab: int, chunk: int, add, acc):
    """acc through add(x, valid, acc) over a row ref in chunks of `chunk` values; the ragged end is the row's last
    `chunk` values, counting only those no whole chunk took."""
    whole = vocab // chunk
    everything = jnp.ones((chunk,), jnp.bool_)
    acc = jax.lax.fori_loop(
        0, whole, lambda i, acc: add(x_ref[pl.ds(pl.multiple_of(i * chunk, chunk), chunk)], everything, acc), acc)
    if vocab % chunk:
        acc = add(x_ref[pl.ds(vocab - chunk, chunk)], vocab - chunk + jnp.arange(chunk) >= whole * chunk, acc)
    return acc


def mass_above(x: jax.Array, cut: jax.Array, top: jax.Array, values: jax.Array, *, rows: jax.Array | None = None,
               interpret: bool = False) -> jax.Array:
    """[S, D]: per row of x [S, V], the sum of exp(x - top) over x >= cut and x > each of its D values [S, D] (D a
    power of two); sampler.mass_above with weights where(x >= cut, exp(x - top), 0). rows [S] bool: the rows to
    sum (others read nothing and give 0); all by default."""
    S, V = x.shape
    D = values.shape[1]
    chunk = min(CHUNK, 1 << (V.bit_length() - 1))  # a power of two no longer than the row
    warps, stages = TUNING
    wanted = jnp.ones((S,), jnp.float32) if rows is None else rows.astype(jnp.float32)
    return pl.pallas_call(
        functools.partial(_kernel, vocab=V, chunk=chunk),
        grid=(S,),
        in_specs=[pl.BlockSpec((None, V), lambda s: (s, 0)), pl.BlockSpec((None, 4), lambda s: (s, 0)),
                  pl.BlockSpec((None, D), lambda s: (s, 0))],
        out_specs=pl.BlockSpec((None, D), lambda s: (s, 0)),
        out_shape=jax.ShapeDtypeStruct((S, D), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="mass_above",
    )(x.astype(jnp.float32), jnp.stack([cut, top, wanted, wanted], axis=1).astype(jnp.float32),
      values.astype(jnp.float32))
