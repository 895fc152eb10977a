"""A linear weight in GGUF's blocks of 32 (Q4_1 or Q8_0) laid out for the native CPU kernel
(kernels/cpu_block_matmul.py): cpu_layout.py converts a one-device model's QuantizedWeights in blocks to these when
that kernel is built and CAPSTAN_CPU_NATIVE_MATMUL allows it. Every matmul of the weight (decode rows and prefill
chunks alike) goes through the kernel; off the CPU (or without the library) the weight is unpacked and multiplied
in JAX, so a program stays correct wherever it runs."""

from __future__ import annotations

import math

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from ..kernels import cpu_block_matmul
from .quantization import QuantizedWeight, flat_axis_name


class CpuBlockWeight(eqx.Module):
    w: jax.Array  # in groups of 8 output columns (cpu_block_matmul.pack): Q4_1 uint8, two values a byte; Q8_0 int8
    d: jax.Array  # float16 [n / 8, k / 32, 8]: each block's scale
    m: jax.Array  # as d: Q4_1 each block's minimum (float16); Q8_0 its sum (int16: the VNNI dot's bias; pack)
    out_axes: tuple[hax.Axis, ...] = eqx.field(static=True)  # the dense weight's output axes
    in_axes: tuple[hax.Axis, ...] = eqx.field(static=True)  # its contracted axes (last, in order)
    kind: int = eqx.field(static=True)  # cpu_block_matmul.Q4_1 or Q8_0

    @staticmethod
    def from_quantized(q: QuantizedWeight, contracted: int) -> CpuBlockWeight:
        """q (its last `contracted` axes the contracted ones, in blocks of 32 along the last) in the kernel's layout."""
        import numpy as np

        out_axes, in_axes = q.weight.axes[: len(q.weight.axes) - contracted], q.weight.axes[-contracted:]
        n, k = math.prod(a.size for a in out_axes), math.prod(a.size for a in in_axes)
        values = np.asarray(q.weight.array).reshape(n, k)
        scale = np.asarray(q.scale.array).reshape(n, k // q.block)
        offset = None if q.offset is None else np.asarray(q.offset.array).reshape(n, k // q.block)
        w, d, m, kind = cpu_block_matmul.pack(values, scale, offset)
        return CpuBlockWeight(jnp.asarray(w), jnp.asarray(d), jnp.asarray(m), tuple(out_axes), tuple(in_axes), kind)

    @property
    def n(self) -> int:
        return math.prod(a.size for a in self.out_axes)

    @property
    def k(self) -> int:
        return self.d.shape[1] * cpu_block_matmul.BLOCK

    def dequantize(self, dtype=jnp.float32) -> NamedArray:
        """The dense weight this stands for, with its axes."""
        dense = cpu_block_matmul.unpack(self.w, self.d, self.m, self.kind, self.n).astype(dtype)
        return hax.named(
            dense.reshape(*(a.size for a in (*self.out_axes, *self.in_axes))), self.out_axes + self.in_axes
        )

    def __call__(self, x: NamedArray, axis) -> NamedArray:
        """x contracted with the weight over `axis` (its contracted axes, or the one they were flattened into)."""
        names = [
            a.name if isinstance(a, hax.Axis) else a for a in (axis if isinstance(axis, (tuple, list)) else (axis,))
        ]
        mine = [a.name for a in self.in_axes]
        if names != mine and not (len(mine) == 1 and mine[0] == flat_axis_name(names)):
            raise ValueError(f"contracted over {names}, but this weight contracts {mine}")
        batch = tuple(a for a in x.axes if a.name not in names)
        rows = math.prod(a.size for a in batch)
        xs = x.rearrange((*batch, *names)).array.reshape(rows, self.k).astype(jnp.float32)
        if cpu_block_matmul.available():
            y = cpu_block_matmul.matmul(xs, self.w, self.d, self.m, self.kind, self.n)
        else:
            y = xs @ cpu_block_matmul.unpack(self.w, self.d, self.m, self.kind, self.n).T
        out = hax.named(y.reshape(*(a.size for a in batch), *(a.size for a in self.out_axes)), (*batch, *self.out_axes))
        return out.astype(x.dtype)
