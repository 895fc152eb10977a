"""Quantized linear weights (vLLM's --quantization): FP8 e4m3 and INT8, one scale per output channel.

A QuantizedWeight stands where a linear layer's NamedArray would: the low-precision weight with the same named
axes (so tensor parallelism splits it as it splits the dense one) and float32 scales over the output axes.
  fp8:  activations cast to e4m3 with a dynamic per-token scale, an e4m3 x e4m3 dot accumulating in float32
        (cuBLASLt FP8 gemms on Hopper; XLA CPU upcasts, so the same math runs in the tests), times both scales.
        Steps of at most FP8_WEIGHT_ONLY_MAX_ROWS rows (one stream's decode) read the same e4m3 weight upcast
        inside the matmul instead: at a few rows the step is weight-bound either way, and the activations'
        quantization kernels around every matmul cost more than the FP8 gemm saves.
  int8: weight-only; the weight is upcast to the activations' dtype inside the matmul, then scaled.
  int8 in blocks (GGUF Q8_0, kept as llama.cpp wrote it): one scale per 32 consecutive inputs of a row; the
        weight is upcast and scaled block by block, then multiplied (XLA writes that bf16 copy each step); on GPUs
        a decode step's matmuls read the blocks in place instead (gpu_gemv.py: 3x faster).
Embeddings, norms and the LM head stay in the model dtype."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Generic

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from ..arrays import HostOrDevice
from ..kernels import gpu_gemv
from ..parallel.mesh import model_parallel_size
from .config import UnsupportedModelError
from .folded_weight import FoldedWeight

QUANTIZATIONS = ("fp8", "int8")
NONE = "none"  # no quantization at load: a quantized GGUF's weights dequantized (CPUs serve them as INT8 otherwise)
FLAG = "--quantization"
FP8 = jnp.float8_e4m3fn
STORAGE = {"fp8": FP8, "int8": jnp.int8}
LARGEST = {"fp8": 448.0, "int8": 127.0}  # the largest finite e4m3 value; the int8 range kept symmetric
TINY = 1e-12  # the scale of an all-zero row or token (any positive number would do)
FLAT_JOIN = "+"  # flat_axis_name
# see the module's docstring; CAPSTAN_FP8_WEIGHT_ONLY_MAX_ROWS=0 keeps the FP8 gemm at every size (benchmarks compare)
FP8_WEIGHT_ONLY_MAX_ROWS = int(os.environ.get("CAPSTAN_FP8_WEIGHT_ONLY_MAX_ROWS", "8"))
# CPU INT8 matmuls of up to this many rows stream the int8 weight through the loops of cpu_int8_matmul; more rows
# dequantize the weight first (30 layers of SmolLM2-135M in Q8_0 blocks, 2 cores: per-row loops 11 / 37 / 139 / 568 ms
# at 4 / 16 / 64 / 256 rows, dequantized 133 / 155 / 254 ms at 16 / 64 / 256: a one-off timing of the 30 layers'
# matmuls while this was written, not a kept benchmark; CAPSTAN_CPU_GEMV_MAX_ROWS moves the switch to remeasure)
CPU_GEMV_MAX_ROWS = int(os.environ.get("CAPSTAN_CPU_GEMV_MAX_ROWS", "64"))
# From this many rows the weight is upcast a tile of output rows at a time, once for all the step's rows, instead of
# once per row (a one-off 2-core timing, not a kept benchmark, of SmolLM2-135M's Q4_1 shapes at 4 / 16 / 64 rows,
# medians of 20: 576 x 576 0.116 / 0.271 / 1.033 ms per row against 0.064 / 0.104 / 0.241 in tiles of 64; the
# 49152-row Q8_0 head 3.9 / 16.9 / 50.4 against 3.9 / 6.9 / 14.0 in tiles of 768; below 8 rows the per-row loop is as
# fast or faster for the MLP's shapes; end to end at 4 streams the tiles from 4 rows ran 106.7 against 167.1
# tokens/s: XLA spreads one large matrix-vector loop over both cores, not the tiles' small dots; RESULTS.md).
# CAPSTAN_CPU_TILED_MIN_ROWS moves the switch.
CPU_TILED_MIN_ROWS = int(os.environ.get("CAPSTAN_CPU_TILED_MIN_ROWS", "8"))


def check_method(method: str | None) -> None:
    if method is not None and method not in (*QUANTIZATIONS, NONE):
        raise ValueError(f"{FLAG}={method!r} is not supported; choose one of {', '.join((*QUANTIZATIONS, NONE))}")


@dataclasses.dataclass(frozen=True)
class QuantizedTensor(Generic[HostOrDevice]):
    """A linear weight as loaded, in Hugging Face's [out, in] layout: values (int8 or e4m3) and scale [out], or
    with `block` (GGUF Q8_0: 32) scale [out, in / block], one per block of consecutive inputs, and, for GGUF Q4_1
    kept on CPUs, offset (each block's minimum: value = scale * q + offset). Read from a file on the host (numpy),
    then put on the device."""

    values: HostOrDevice
    scale: HostOrDevice
    block: int = 0
    offset: HostOrDevice | None = None

    @property
    def method(self) -> str:
        return "fp8" if self.values.dtype == FP8 else "int8"


def quantize_rows(w, method: str) -> QuantizedTensor:
    """Symmetric quantization of w [out, in] with one scale per row: scale = amax / largest, values = w / scale."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.where(amax > 0, amax / LARGEST[method], TINY)
    scaled = jnp.clip(w / scale[:, None], -LARGEST[method], LARGEST[method])
    values = jnp.round(scaled).astype(jnp.int8) if method == "int8" else scaled.astype(FP8)
    return QuantizedTensor(values, scale.astype(jnp.float32))


def quantize_blocks(w, block: int = 32) -> QuantizedTensor:
    """GGUF Q8_0's scheme: per `block` consecutive values of a row, scale = amax / 127, values = round(w / scale).
    A host (numpy) array is quantized on the host, to host arrays (a load compiles no program for it); the same
    IEEE float32 arithmetic either way."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w = xp.asarray(w, xp.float32)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // block, block)
    amax = xp.max(xp.abs(blocks), axis=-1)
    scale = xp.where(amax > 0, amax / xp.float32(LARGEST["int8"]), xp.float32(TINY))
    values = xp.round(blocks / scale[..., None]).astype(xp.int8).reshape(w.shape)
    return QuantizedTensor(values, scale.astype(xp.float32), block)


def dequantize_rows(t: QuantizedTensor) -> jax.Array:
    if t.block:
        blocks = t.values.astype(jnp.float32).reshape(*t.scale.shape, t.block) * t.scale[..., None]
        if t.offset is not None:
            blocks = blocks + t.offset[..., None]
        return blocks.reshape(t.values.shape)
    return t.values.astype(jnp.float32) * t.scale[:, None]


class QuantizedWeight(eqx.Module):
    weight: NamedArray  # int8 or float8_e4m3fn, the dense weight's axes
    scale: NamedArray  # float32 per output channel: the weight's axes less the contracted ones (see `block`)
    # 0: per output channel; else (GGUF Q8_0) the scale's last axis counts blocks of `block` along the weight's
    # last axis, the innermost of the contracted ones
    block: int = eqx.field(static=True, default=0)
    # GGUF Q4_1 kept on CPUs: each block's minimum, the scale's axes (value = scale * q + offset); None: symmetric
    offset: NamedArray | None = None

    @property
    def method(self) -> str:
        return "fp8" if self.weight.dtype == FP8 else "int8"

    def dequantize(self, dtype=jnp.float32) -> NamedArray:
        if self.block:
            return self._unblocked(dtype)
        return (self.weight.astype(jnp.float32) * self.scale).astype(dtype)

    def _unblocked(self, dtype) -> NamedArray:
        offset = None if self.offset is None else self.offset.array
        return hax.named(
            _dequantize_blocks(self.weight.array, self.scale.array, offset, self.block, dtype), self.weight.axes
        )

    def __call__(self, x: NamedArray, axis) -> NamedArray:
        """x contracted with the weight over `axis` (what hax.dot(x, dense, axis=axis) computes)."""
        if self.block:
            return hax.dot(x, self._unblocked(x.dtype), axis=axis, preferred_element_type=jnp.float32).astype(x.dtype)
        rows = x.size // hax.axis_size(x.resolve_axis(axis))  # tokens (the axes not contracted)
        if self.method == "fp8" and rows > FP8_WEIGHT_ONLY_MAX_ROWS:
            x32 = x.astype(jnp.float32)
            x_scale = hax.maximum(hax.max(hax.abs(x32), axis=axis), TINY) / LARGEST["fp8"]
            xq = hax.clip(x32 / x_scale, -LARGEST["fp8"], LARGEST["fp8"]).astype(FP8)
            y = hax.dot(xq, self.weight, axis=axis, preferred_element_type=jnp.float32)
            return (y * x_scale * self.scale).astype(x.dtype)
        y = hax.dot(x, self.weight.astype(x.dtype), axis=axis, preferred_element_type=jnp.float32)
        return (y * self.scale).astype(x.dtype)


def linear(x: NamedArray, w: NamedArray | QuantizedWeight, axis) -> NamedArray:
    """A linear layer's matmul for a dense or a quantized weight; a decode step's through gpu_gemv's kernel where it
    applies (by default GGUF Q8_0 blocks); on CPUs an INT8 weight's without a float copy (cpu_int8_matmul)."""
    if isinstance(w, FoldedWeight):  # a LoRA engine's weight with its slots' A rows: the base's columns alone
        return folded_matmul(x, w, axis)[0]
    if not isinstance(w, (NamedArray, QuantizedWeight)):  # cpu_block_weight.CpuBlockWeight: the native CPU kernel
        return w(x, axis)
    y = _in_gemv_kernel(x, w, axis)
    if y is None:
        y = cpu_int8_matmul(x, w, axis)
    if y is not None:
        return y
    if isinstance(w, QuantizedWeight):
        return w(x, axis)
    return hax.dot(x, w, axis=axis)


@dataclasses.dataclass(frozen=True)
class _Matrices:
    """x contracted with a weight over the weight's last axes, as the 2-D matmul [rows, k] x [n, k]^T."""

    xs: jax.Array  # [rows, k]
    batch: tuple  # x's axes that are not contracted (the result's first)
    out_axes: tuple  # the weight's axes that are not contracted (the result's last)
    rows: int
    k: int
    n: int

    def result(self, y: jax.Array) -> NamedArray:
        return hax.named(
            y.reshape(*(a.size for a in self.batch), *(a.size for a in self.out_axes)), (*self.batch, *self.out_axes)
        )


def folded_matmul(x: NamedArray, w: FoldedWeight, axis) -> tuple[NamedArray, jax.Array]:
    """x through a FoldedWeight in one plain matmul: the projection (named as the weight's outputs after x's other
    axes) and the extra columns, every slot's rank space [rows, extra]."""
    m = as_matrices(x, w, axis)
    assert m is not None, "weights are folded on one device only, with their contracted axes last"
    y = m.xs @ w.matrix.T
    return m.result(y[:, : w.n]), y[:, w.n :]


def flat_axis_name(names) -> str:
    """The one axis a CPU weight's contracted axes are flattened into (cpu_layout.py), named after them."""
    return FLAT_JOIN.join(names)


def as_matrices(x: NamedArray, weight: NamedArray | FoldedWeight, axis) -> _Matrices | None:
    """None for a weight split over devices, or contracted axes that are not the weight's last (its [out, in]
    layout), or flattened into its last (cpu_layout.py)."""
    if model_parallel_size() != 1:
        return None
    names = [a.name if isinstance(a, hax.Axis) else a for a in (axis if isinstance(axis, (tuple, list)) else (axis,))]
    if weight.axes[-1].name == flat_axis_name(names):
        out_axes = weight.axes[:-1]
    elif [a.name for a in weight.axes[len(weight.axes) - len(names) :]] == names:
        out_axes = weight.axes[: len(weight.axes) - len(names)]
    else:
        return None
    batch = tuple(a for a in x.axes if a.name not in names)
    n = math.prod(a.size for a in out_axes)
    k = weight.size // n
    rows = x.size // k
    return _Matrices(x.rearrange((*batch, *names)).array.reshape(rows, k), batch, out_axes, rows, k, n)


def _cpu_tile(n: int) -> int:
    """Output rows a tile of cpu_int8_matmul's tiled loop upcasts at once (0: n has no such tile): 64 for the
    projections, 768 for an LM head (fewer, larger tiles measured faster there), the largest that divides n."""
    for tile in (768, 384, 192, 64) if n > 4096 else (64,):
        if n % tile == 0:
            return tile
    return 0


def _dequantize_blocks(
    q: jax.Array, scale: jax.Array, offset: jax.Array | None, block: int, dtype=jnp.float32
) -> jax.Array:
    """Values in blocks of `block` along the last axis -> dtype (scale * q + offset; scale and offset count blocks)."""
    blocks = q.astype(dtype).reshape(*q.shape[:-1], -1, block) * scale[..., None].astype(dtype)
    if offset is not None:
        blocks = blocks + offset[..., None].astype(dtype)
    return blocks.reshape(q.shape)


def cpu_int8_matmul(x: NamedArray, w: NamedArray | QuantizedWeight, axis) -> NamedArray | None:
    """x contracted with an INT8 weight (GGUF Q8_0 blocks, or one scale per output channel) on CPUs, weight-only:
    float32 activations times the weight upcast and scaled, in loops that read the int8 bytes without writing a
    float copy of the weight first (XLA's CPU dot would write one every step: slower than float32 weights). One row
    (a stream's decode step): XLA fuses the upcast into one matrix-vector loop; up to CPU_GEMV_MAX_ROWS rows of a
    weight in blocks: from CPU_TILED_MIN_ROWS rows, a loop over tiles of output rows, each tile upcast once and
    multiplied with every row, below that (and for per-channel weights) the matrix-vector loop once per row
    (lax.map); more (prefill chunks): the weight dequantized, then XLA's dot. None elsewhere: other backends, other
    formats, a weight split over devices."""
    if not (jax.default_backend() == "cpu" and isinstance(w, QuantizedWeight) and w.method == "int8"):
        return None
    m = as_matrices(x, w.weight, axis)
    if m is None:
        return None
    q = w.weight.array.reshape(m.n, m.k)
    if w.block:  # the scale's axes are the weight's, its last counting blocks along the weight's last axis
        scale = w.scale.array.reshape(m.n, m.k // w.block)
        offset = None if w.offset is None else w.offset.array.reshape(m.n, m.k // w.block)
    else:
        scale, offset = w.scale.rearrange(m.out_axes).array.reshape(m.n), None

    def upcast(q):
        return _dequantize_blocks(q, scale, offset, w.block) if w.block else q.astype(jnp.float32)

    def matrix_vector(row):  # [1, k] -> [1, n]
        # tied to this row: in a decode scan (or the rows' loop) XLA would otherwise hoist the upcast out of the
        # loop, writing the float32 copy of every weight that each step then reads
        q_row, row = jax.lax.optimization_barrier((q, row))
        y = row @ upcast(q_row).T
        return y if w.block else y * scale

    def tiled(xs, tile: int):  # [rows, k] -> [rows, n], the weight upcast one tile of output rows at a time
        tiles = m.n // tile
        parts = [q, scale] + ([] if offset is None else [offset])
        parts = [a.reshape(tiles, tile, *a.shape[1:]) for a in parts]

        def one_tile(part):
            # tied to the rows as matrix_vector is: the tile's float copy stays small (cache-resident), never whole
            part, rows = jax.lax.optimization_barrier((part, xs))
            q_t, scale_t, *rest = part
            return rows @ _dequantize_blocks(q_t, scale_t, rest[0] if rest else None, w.block).T  # [rows, tile]

        y = jax.lax.map(one_tile, parts)  # [tiles, rows, tile]
        return jnp.moveaxis(y, 0, 1).reshape(m.rows, m.n)

    xs = m.xs.astype(jnp.float32)
    tile = _cpu_tile(m.n) if w.block and m.rows >= CPU_TILED_MIN_ROWS else 0
    if m.rows == 1:
        y = matrix_vector(xs)
    elif m.rows <= CPU_GEMV_MAX_ROWS and tile:
        y = tiled(xs, tile)
    elif m.rows <= CPU_GEMV_MAX_ROWS:
        y = jax.lax.map(lambda row: matrix_vector(row[None])[0], xs)
    else:
        y = xs @ upcast(q).T
        y = y if w.block else y * scale
    return m.result(y.astype(x.dtype))


def _in_gemv_kernel(x: NamedArray, w: NamedArray | QuantizedWeight, axis) -> NamedArray | None:
    """x contracted with w by gpu_gemv's kernel, or None where it does not apply (gpu_gemv.applies: by default GGUF
    Q8_0 blocks only), for a weight split over devices, or contracted axes that are not the weight's last (its
    [out, in] layout)."""
    weight, scale = (w.weight, w.scale) if isinstance(w, QuantizedWeight) else (w, None)
    block = w.block if isinstance(w, QuantizedWeight) else 0
    m = as_matrices(x, weight, axis)
    offset = w.offset if isinstance(w, QuantizedWeight) else None
    if m is None or offset is not None or not gpu_gemv.applies(m.rows, m.k, m.n, weight.dtype, block):
        return None
    xs, out_axes, n, k = m.xs, m.out_axes, m.n, m.k
    if block:  # the scale's axes are the weight's, its last counting blocks (QuantizedWeight._unblocked)
        assert scale is not None, "a weight in blocks has their scales"
        s = scale.array.reshape(n, k // block)
    else:
        s = None if scale is None else scale.rearrange(out_axes).array.reshape(n)
    return m.result(gpu_gemv.gemv(xs, weight.array.reshape(n, k), s, block=block))


def as_numpy_scale(scale, rows: int, name: str) -> np.ndarray:
    """A checkpoint's weight scale as one float32 per output row: [out], [out, 1] (per channel) or a scalar
    (per tensor, broadcast: exact)."""
    s = np.asarray(scale, np.float32)
    if s.size == 1:
        return np.full((rows,), s.reshape(()), np.float32)
    if s.shape in ((rows,), (rows, 1)):
        return s.reshape(rows)
    raise UnsupportedModelError(
        f"{name}: scale of shape {s.shape} is neither per tensor nor per output channel (rows={rows})"
    )
