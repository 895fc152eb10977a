"""A LoRA projection's delta for a few tokens on NVIDIA GPUs: y + x @ A[slot] @ B[slot] in one Pallas (Triton) kernel.

A one-stream decode step is bound by kernel launches, not bytes: models/lora.py's XLA path takes several small
kernels per projection (shrink, slot mask or gather, expand, add), seven projections a layer. Here one launch does it
all: a program owns `block_n` output columns of one part; for each token it reads the token's own slot (-1: none, y
is copied unchanged), recomputes the tiny shrink h = x_t @ A[slot]^T (R values, walking the contracted axis in
`block_k` slices on the CUDA cores), expands h over its columns of B[slot] and adds them to y's. The output is y's
buffer (aliased). Every program reads each token's [R, in] of A again: a few hundred KB from L2 at decode sizes."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .gpu_gemv import largest_pow2_divisor

# Steps of at most this many tokens take the kernel on a GPU (CAPSTAN_LORA_KERNEL_MAX_TOKENS; 0: never). Its work
# is one shrink per token and program, so it is for decode steps; larger steps take models/lora.py's dense matmuls.
# Off by default until a GPU run has compiled and timed it (`gpu_suite.sh lorakernel` sets 16): so far it has run
# only in Pallas' interpreter and been lowered to Triton on CPU, never compiled or run on a GPU.
MAX_TOKENS = int(os.environ.get("CAPSTAN_LORA_KERNEL_MAX_TOKENS", "0"))
# Run it on any backend in Pallas' interpreter (CAPSTAN_LORA_KERNEL=interpret: the CPU tests' way to exercise it)
INTERPRET = os.environ.get("CAPSTAN_LORA_KERNEL", "") == "interpret"
MAX_BLOCK_N = 256  # output columns a program takes (fewer programs: each recomputes the shrink)
MAX_BLOCK_K = 256  # contracted slice a shrink step loads
NUM_WARPS = 4


def applies(tokens: int, rank: int, k: int, n: int, backend: str | None = None) -> bool:
    """Whether the kernel takes a step of `tokens` tokens for a rank-`rank` delta of x[tokens, k] to y[tokens, n]:
    few tokens, sizes Triton can tile (its loads are powers of two), a GPU (or INTERPRET)."""
    if not 0 < tokens <= MAX_TOKENS or rank & (rank - 1) or k % 16 or n % 16:
        return False
    return INTERPRET or (backend or jax.default_backend()) == "gpu"


def _kernel(slots_ref, x_ref, a_ref, b_ref, y_ref, o_ref, *, tokens: int, parts: int, summed: bool, block_k: int):
    steps = x_ref.shape[1] // block_k
    rank = a_ref.shape[-2]
    p_own = pl.program_id(0)

    def token(t, carry):
        slot = slots_ref[t]
        s = jnp.maximum(slot, 0)
        live = (slot >= 0).astype(jnp.float32)  # base rows: a zero delta

        def part(p):
            def shrink(i, h):
                k0 = pl.multiple_of(i * block_k, block_k)
                xk = x_ref[t, pl.ds(k0, block_k)].astype(jnp.float32)  # [block_k]
                ak = a_ref[s, p, :, pl.ds(k0, block_k)].astype(jnp.float32)  # [R, block_k]
                return h + jnp.sum(ak * xk[None, :], axis=1)

            h = jax.lax.fori_loop(0, steps, shrink, jnp.zeros((rank,), jnp.float32)) * live
            b = b_ref[s, p, :, :].astype(jnp.float32)  # [R, block_n]
            return jnp.sum(h[:, None] * b, axis=0)

        if summed:  # every part adds into the same columns (q, k and v of the fused projection)
            d = part(0)
            for p in range(1, parts):
                d = d + part(p)
        else:
            d = part(p_own)
        o_ref[t, :] = (y_ref[t, :].astype(jnp.float32) + d).astype(o_ref.dtype)
        return carry

    jax.lax.fori_loop(0, tokens, token, 0)


@functools.partial(jax.jit, static_argnames=("summed", "interpret"))
def lora_delta(
    y: jax.Array,
    x: jax.Array,
    a: jax.Array,
    b: jax.Array,
    slots: jax.Array,
    *,
    summed: bool,
    interpret: bool | None = None,
) -> jax.Array:
    """y [T, Q, N] plus each token's x [T, K] @ A[slot]^T @ B[slot] (slot -1: nothing added), in y's dtype.
    a [L, P, R, K], b [L, P, R, N]: P parts, each its own rank-R shrink; summed: all P add into the one output
    (Q = 1), else part p is output p (Q = P). R a power of two; K and N multiples of 16. interpret: Pallas'
    interpreter (None: off a GPU; False: Triton's lowering everywhere, which lowers on a CPU too, not run)."""
    T, Q, N = y.shape
    L, P, R, K = a.shape
    assert b.shape == (L, P, R, N) and x.shape == (T, K) and (1 if summed else P) == Q, (y.shape, a.shape, b.shape)
    block_n = largest_pow2_divisor(N, MAX_BLOCK_N)
    block_k = largest_pow2_divisor(K, MAX_BLOCK_K)
    kernel = functools.partial(_kernel, tokens=T, parts=P, summed=summed, block_k=block_k)
    out_spec = pl.BlockSpec((T, None, block_n), lambda q, j: (0, q, j))
    return pl.pallas_call(
        kernel,
        grid=(Q, N // block_n),
        in_specs=[
            pl.BlockSpec((T,), lambda q, j: (0,)),
            pl.BlockSpec((T, K), lambda q, j: (0, 0)),
            pl.BlockSpec((L, P, R, K), lambda q, j: (0, 0, 0, 0)),
            pl.BlockSpec((L, P, R, block_n), lambda q, j: (0, 0, 0, j)),
            out_spec,
        ],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        input_output_aliases={4: 0},
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=jax.default_backend() != "gpu" if interpret is None else interpret,
        name=f"lora_delta_{block_n=}_{block_k=}",
    )(slots.astype(jnp.int32), x, a, b, y)
