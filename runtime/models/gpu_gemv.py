"""A few tokens times a linear weight on NVIDIA GPUs: one Pallas (Triton) kernel that streams the weight once.

At one stream's decode (one to a few rows) a linear layer is a matrix-vector product, bound by reading the weight.
XLA's GEMMs reach 57-85% of the H100's bandwidth there (benchmarks/RESULTS.md, "Where the time goes") and upcast an
FP8 or INT8 weight no better. Here a program owns `block_n` output channels: it walks the contracted axis in
`block_k` slices, loads the weight's slice in its stored dtype (bf16, e4m3 or int8: half the bytes), upcasts it in
registers and accumulates in float32; the per-channel scale is applied once at the end. When the output channels
alone cannot fill the GPU, the contracted axis is split across programs too (split-K) and XLA sums the float32
partials (fused into the next operation). The weight keeps Hugging Face's [out, in] layout, so nothing is copied."""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 16  # Triton's dots need 16 rows; more tokens than this is a GEMM's job (XLA's)
# Where it runs (CAPSTAN_GEMV): "q8_0" (the default) for GGUF Q8_0 blocks only, which XLA dequantizes into a bf16
# copy of the weight every step; for bf16, FP8 and INT8 weights XLA's own dot was as fast or faster on an H100
# (benchmarks/RESULTS.md, "One stream's matmuls"). "1" for every weight; "0" nowhere; "interpret" for every weight
# on any backend, in Pallas' interpreter (the CPU tests' way to exercise the wiring)
MODE = os.environ.get("CAPSTAN_GEMV", "q8_0")
ENOUGH_PROGRAMS = 264  # two per SM of an H100: below this the contracted axis is split too
BLOCK_K = (512, 256, 128, 64, 32, 16)  # the first that divides the contracted size is used (Triton: powers of two)
# Triton's tuning from `python benchmarks/gemv.py --sweep` (block_n, num_warps, num_stages, reduce)
TUNING = (64, 4, 3, False)


def applies(rows: int, k: int, n: int, stored, block: int = 0, backend: str | None = None) -> bool:
    """Whether the kernel handles x[rows, k] times w[n, k] stored as `stored` (in blocks of `block` inputs with
    their own scales, or not): MODE, few rows, sizes Triton can tile, a GPU."""
    if MODE == "0" or MODE == "q8_0" and not block:
        return False
    b = _block_k(k)
    if rows > MAX_ROWS or b is None or n % 16 or block and (b % block or block & (block - 1)):
        return False
    return MODE == "interpret" or (backend or jax.default_backend()) == "gpu"


def _block_k(k: int) -> int | None:
    return next((b for b in BLOCK_K if k % b == 0), None)


def _block_n(n: int, most: int) -> int:
    """The largest power of two up to `most` dividing n (n is a multiple of 16)."""
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


@functools.partial(jax.jit, static_argnames=("block", "block_n", "block_k", "splits", "num_warps", "num_stages",
                                             "reduce"))
def gemv(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *, block: int = 0, block_n: int | None = None,
         block_k: int | None = None, splits: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None, reduce: bool | None = None) -> jax.Array:
    """x[rows, k] @ w[n, k].T, in x's dtype, times scale (float32): scale[n] per output channel, or with `block`
    (GGUF Q8_0: 32) scale[n, k / block] per run of `block` inputs. The tuning arguments default to TUNING and the
    split rule above (benchmarks/gemv.py sweeps them); reduce: multiply-add and sum instead of a tensor-core dot
    (rows padded to a power of two rather than 16)."""
    rows, k = x.shape
    n = w.shape[0]
    bn, warps, stages, by_reduce = TUNING
    reduce = by_reduce if reduce is None else reduce
    block_n = _block_n(n, block_n or bn)
    block_k = block_k or _block_k(k)
    assert not block or block_k % block == 0, (block_k, block)
    steps = k // block_k
    splits = splits or _splits(n // block_n, steps)
    padded = 1 << (rows - 1).bit_length() if reduce else -(-rows // 16) * 16
    xp = jnp.pad(x, ((0, padded - rows), (0, 0)))
    fused_scale = scale is not None and (splits == 1 or block)
    out_dtype = x.dtype if splits == 1 else jnp.float32
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, block_k=block_k, steps=steps // splits, precision=precision,
                               reduce=reduce, block=block)
    scale_spec = (pl.BlockSpec((block_n, k // block), lambda j, s: (j, 0)) if block
                  else pl.BlockSpec((block_n,), lambda j, s: (j,)))
    out = pl.pallas_call(
        kernel,
        grid=(n // block_n, splits),
        in_specs=[
            pl.BlockSpec((padded, k), lambda j, s: (0, 0)),
            pl.BlockSpec((block_n, k), lambda j, s: (j, 0)),
            scale_spec if fused_scale else None,
        ],
        out_specs=pl.BlockSpec((None, padded, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, padded, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or warps, num_stages=num_stages or stages),
        interpret=MODE == "interpret" or jax.default_backend() != "gpu",
        name=f"gemv_{block_n=}_{block_k=}_{splits=}",
    )(xp, w, scale if fused_scale else None)
    y = out[0] if splits == 1 else out.sum(axis=0)
    if scale is not None and not fused_scale:
        y = y * scale[None, :]
    return y[:rows].astype(x.dtype)
