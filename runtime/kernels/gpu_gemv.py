"""A few tokens times a linear weight on NVIDIA GPUs: one Pallas (Triton) kernel that streams the weight once.

At a decode step a linear layer is bound by reading its weight. For GGUF Q8_0 blocks (int8, a scale per 32 inputs)
XLA has no fused path: it writes a bf16 copy of the weight every step and reads that (3x bf16's time). Here a
program owns `block_m` rows and `block_n` output channels: it walks the contracted axis in `block_k` slices, loads
the weight's slice as stored (int8 blocks and their scales, or bf16, e4m3, int8 with per-channel scales), scales
and upcasts it in registers, and accumulates in float32. When the programs would not fill the GPU, the
contracted axis is split across them too (split-K) and XLA sums the float32 partials (fused into the next
operation). The weight keeps Hugging Face's [out, in] layout, so nothing is copied. For bf16, FP8 and INT8 weights
XLA's own GEMMs were as fast or faster (benchmarks/RESULTS.md, "One stream's matmuls"), so by default only Q8_0
comes here."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 16  # tokens a step up to which a per-channel or dense weight may come here (its GEMV regime)
Q8_0_MAX_ROWS = 256  # Q8_0: a batch's decode too (larger steps, prefill chunks, dequantize once and run a GEMM)
MAX_BLOCK_M = 64  # rows a program takes; Triton's dots need at least 16
# Where it runs (CAPSTAN_GEMV): "q8_0" (the default) for GGUF Q8_0 blocks only, which XLA dequantizes into a bf16
# copy of the weight every step; for bf16, FP8 and INT8 weights XLA's own dot was as fast or faster on an H100
# (benchmarks/RESULTS.md, "One stream's matmuls"). "1" for every weight; "0" nowhere; "interpret" for every weight
# on any backend, in Pallas' interpreter (the CPU tests' way to exercise the wiring)
MODE = os.environ.get("CAPSTAN_GEMV", "q8_0")
ENOUGH_PROGRAMS = 264  # two per SM of an H100: below this the contracted axis is split too
BLOCK_K = (512, 256, 128, 64, 32, 16)  # the first that divides the contracted size is used (Triton: powers of two)
# Triton's tuning (block_n, num_warps, num_stages, reduce): a first choice; `python benchmarks/gemv.py --sweep` found
# no other better across the bf16 and FP8 shapes it tried (Q8_0 was not swept)
TUNING = (64, 4, 3, False)


def applies(rows: int, k: int, n: int, stored, block: int = 0, backend: str | None = None) -> bool:
    """Whether the kernel handles x[rows, k] times w[n, k] stored as `stored` (in blocks of `block` inputs with
    their own scales, or not): MODE, few rows, sizes Triton can tile, a GPU."""
    if MODE == "0" or MODE == "q8_0" and not block:
        return False
    b = _block_k(k, _block_m(rows))
    if rows > (Q8_0_MAX_ROWS if block else MAX_ROWS) or b is None or n % 16:
        return False
    if block and (b % block or block & (block - 1)):
        return False
    return MODE == "interpret" or (backend or jax.default_backend()) == "gpu"


def _block_m(rows: int) -> int:
    return min(MAX_BLOCK_M, max(16, 1 << (rows - 1).bit_length()))


def _block_k(k: int, block_m: int = 16) -> int | None:
    """The largest slice of BLOCK_K dividing k; at most 128 for taller row blocks (their tiles, staged, must fit
    shared memory)."""
    return next((b for b in BLOCK_K if k % b == 0 and (block_m <= 16 or b <= 128)), None)


def largest_pow2_divisor(n: int, most: int) -> int:
    """The largest power of two up to `most` (a power of two) dividing n: a Triton block along an axis of n."""
    b = most
    while n % b:
        b //= 2
    return b


def _splits(n_blocks: int, k_steps: int) -> int:
    """Split the contracted axis in as many parts (dividing its steps) as it takes to have ENOUGH_PROGRAMS."""
    want = -(-ENOUGH_PROGRAMS // n_blocks)
    return max([d for d in range(1, k_steps + 1) if k_steps % d == 0 and d <= want] or [1])


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_k: int, steps: int, precision, reduce: bool, block: int):
    first = pl.program_id(1) * steps * block_k  # this program's share of the contracted axis

    def body(i, acc):
        k0 = pl.multiple_of(first + i * block_k, block_k)
        x = x_ref[:, pl.ds(k0, block_k)]
        w = w_ref[:, pl.ds(k0, block_k)]
        if block:  # GGUF Q8_0: each run of `block` inputs of a row has its own scale, applied before the dot
            bn, per = w.shape[0], block_k // block
            scales = s_ref[:, pl.ds(pl.multiple_of(k0 // block, per), per)]
            w = (w.astype(jnp.float32).reshape(bn, per, block) * scales[:, :, None]).reshape(bn, block_k)
        if reduce:  # multiply-adds on the CUDA cores, no padding to a tensor-core tile
            return acc + jnp.sum(x.astype(jnp.float32)[:, None, :] * w.astype(jnp.float32)[None, :, :], axis=-1)
        return acc + plgpu.dot(x, w.astype(x.dtype), trans_b=True, precision=precision)  # upcast in registers

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((x_ref.shape[0], w_ref.shape[0]), jnp.float32))
    if s_ref is not None and not block:
        acc = acc * s_ref[...][None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("block", "block_n", "block_k", "splits", "num_warps", "num_stages", "reduce")
)
def gemv(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None = None,
    *,
    block: int = 0,
    block_n: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    reduce: bool | None = None,
) -> jax.Array:
    """x[rows, k] @ w[n, k].T, in x's dtype, times scale (float32): scale[n] per output channel, or with `block`
    (GGUF Q8_0: 32) scale[n, k / block] per run of `block` inputs. The tuning arguments default to TUNING and the
    split rule above (benchmarks/gemv.py sweeps them); reduce: multiply-add and sum instead of a tensor-core dot
    (rows padded to a power of two rather than 16)."""
    rows, k = x.shape
    n = w.shape[0]
    bn, warps, stages, by_reduce = TUNING
    reduce = (by_reduce if reduce is None else reduce) and rows <= 16  # multiply-adds: a GEMV's few rows only
    block_n = largest_pow2_divisor(n, block_n or bn)
    block_m = 1 << (rows - 1).bit_length() if reduce else _block_m(rows)
    block_k = block_k or _block_k(k, block_m)
    assert block_k is not None, f"no block of {BLOCK_K} divides k={k} (applies() refuses such shapes)"
    assert not block or block_k % block == 0, (block_k, block)
    steps = k // block_k
    m_blocks = -(-rows // block_m)
    splits = splits or _splits(n // block_n * m_blocks, steps)
    assert steps % splits == 0, (steps, splits)
    padded = m_blocks * block_m
    xp = jnp.pad(x, ((0, padded - rows), (0, 0)))
    fused_scale = scale is not None and (splits == 1 or block)
    out_dtype = x.dtype if splits == 1 else jnp.float32
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, block_k=block_k, steps=steps // splits, precision=precision, reduce=reduce, block=block
    )
    scale_spec = (
        pl.BlockSpec((block_n, k // block), lambda j, s, i: (j, 0))
        if block
        else pl.BlockSpec((block_n,), lambda j, s, i: (j,))
    )
    out = pl.pallas_call(
        kernel,
        grid=(n // block_n, splits, m_blocks),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda j, s, i: (i, 0)),
            pl.BlockSpec((block_n, k), lambda j, s, i: (j, 0)),
            scale_spec if fused_scale else None,
        ],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda j, s, i: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, padded, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or warps, num_stages=num_stages or stages),
        interpret=MODE == "interpret" or jax.default_backend() != "gpu",
        name=f"gemv_{block_m=}_{block_n=}_{block_k=}_{splits=}",
    )(xp, w, scale if fused_scale else None)
    y = out[0] if splits == 1 else out.sum(axis=0)
    if scale is not None and not fused_scale:
        y = y * scale[None, :]
    return y[:rows].astype(x.dtype)
