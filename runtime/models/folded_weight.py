"""A dense projection's weight stored with every LoRA slot's A rows after its own, so a step's shrink (x @ A) rides
in the base weight's own matmul with nothing concatenated in the step (models/lora.py, FOLD_STORED).

The weight [out..., in...] becomes one matrix [n + extra, k]: its n = prod(out) rows, then `extra` rows of every
slot's A. One plain matmul gives [rows, n + extra]: the base projection, then every slot's rank space. The base
model's own steps (rows without adapters) read the same matrix and drop the extra columns: with one slot of rank 16,
under 2% more bytes a projection."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from haliax import NamedArray


class FoldedWeight(eqx.Module):
    matrix: jax.Array  # [n + extra, k]
    axes: tuple = eqx.field(static=True)  # the weight's own named axes: the outputs', then the contracted ones
    n: int = eqx.field(static=True)  # the weight's own rows

    @staticmethod
    def fold(weight: NamedArray, a_rows: jax.Array) -> FoldedWeight:
        """weight (its contracted axes last, as the model holds them) with a_rows [extra, k] after it."""
        k = a_rows.shape[-1]
        n = weight.size // k
        matrix = jnp.concatenate([weight.array.reshape(n, k), a_rows.astype(weight.dtype)])
        return FoldedWeight(matrix, tuple(weight.axes), n)

    @property
    def size(self) -> int:  # the weight's own (quantization.as_matrices reads axes and size)
        return math.prod(a.size for a in self.axes)

    @property
    def dtype(self):
        return self.matrix.dtype

    def with_rows(self, start: int | jax.Array, rows: jax.Array) -> FoldedWeight:
        """rows [r, k] written over the extra rows from `start` (counted after the weight's own)."""
        matrix = jax.lax.dynamic_update_slice(self.matrix, rows.astype(self.dtype), (self.n + start, 0))
        return FoldedWeight(matrix, self.axes, self.n)
