"""The native CPU block matmul (kernels/cpu_block_matmul.py, runtime/kernels/cpu/block_matmul.cc) against the pure
paths, for Q4_1 and Q8_0, 1 to 64 rows, output counts that are not multiples of 8, each instruction set this CPU runs
and 1 to 3 threads.

Two references. (1) The same arithmetic in numpy (activations quantized per block of 32 to int8, as llama.cpp's
q8_1, scales in float16): equal up to float32 summation order (TIGHT). (2) The float weight's dot with the float
activations (what quantization.cpu_int8_matmul computes): the kernel's only extra error is the activations'
rounding, half a step (amax / 127 / 2) per input and the float16 scales' (rounding_bound), plus float32 noise."""

from __future__ import annotations

import os
import platform

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.kernels import cpu_block_matmul
from capstan.runtime.models import cpu_block_weight, cpu_layout
from capstan.runtime.models.cpu_block_weight import CpuBlockWeight
from capstan.runtime.models.quantization import QuantizedWeight, cpu_int8_matmul

BLOCK = 32
TIGHT = 2e-5  # of max |y|: float32 sums in another order
FLOAT_NOISE = 1e-4  # of max |y|, beside the rounding bound

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or jax.default_backend() != "cpu",
    reason="the native kernel is x86-64 CPU only",
)


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_block_matmul.build()  # make setup builds it; here too, so the test runs on a tree set up before it existed
    assert cpu_block_matmul.available()
    yield
    cpu_block_matmul.configure("", None)


def blocks(n: int, k: int, q4_1: bool, rng):
    q = rng.integers(0, 16, (n, k)) if q4_1 else rng.integers(-127, 128, (n, k))
    # float16 values, as a GGUF's scales and minimums (the kernel's layout keeps them in float16)
    scale = rng.uniform(0.001, 0.02, (n, k // BLOCK)).astype(np.float16).astype(np.float32)
    offset = (-8 * scale * rng.uniform(0.5, 1.5, scale.shape)).astype(np.float16).astype(np.float32) if q4_1 else None
    return q.astype(np.int8), scale, offset


def dense(q, scale, offset) -> np.ndarray:
    n, k = q.shape
    w = q.astype(np.float64).reshape(n, k // BLOCK, BLOCK) * scale[..., None]
    return (w if offset is None else w + offset[..., None]).reshape(n, k)


def _level(xb: np.ndarray, half: bool):
    """One level of blocks [rows, nb, 32] (float32) quantized as the kernel does: (int8 values, scale, scaled sum)."""
    amax = np.abs(xb).max(-1)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64)  # [rows, nb, 32]
    s = d * xq.sum(-1).astype(np.float32)
    if half:  # llama.cpp's q8_1 / q8_0 keep the scale and the sum in float16
        return xq, d.astype(np.float16).astype(np.float64), s.astype(np.float16).astype(np.float64)
    return xq, d.astype(np.float64), s.astype(np.float64)


def emulated(x: np.ndarray, q, scale, offset, levels: int = 1) -> np.ndarray:
    """The kernel's arithmetic in numpy, float64: x quantized per block (one level as llama.cpp, float16 scales; or
    two, the second what the first's rounding left, float32 scales), integer dots, both scales, the minimum term."""
    rows, k = x.shape
    xb = x.reshape(rows, k // BLOCK, BLOCK).astype(np.float32)
    qb = q.astype(np.int64).reshape(q.shape[0], k // BLOCK, BLOCK)  # [n, nb, 32]
    y = np.zeros((rows, q.shape[0]))
    for _ in range(levels):
        xq, dx, sx = _level(xb, half=levels == 1)
        dots = np.einsum("rbi,nbi->rnb", xq, qb).astype(np.float64)
        y += np.einsum("rnb,nb,rb->rn", dots, scale.astype(np.float64), dx)
        if offset is not None:  # and the block's scaled sum
            y += np.einsum("nb,rb->rn", offset.astype(np.float64), sx)
        xb = xb - dx.astype(np.float32)[..., None] * xq.astype(np.float32)  # what this level's rounding left
    return y


def rounding_bound(x: np.ndarray, q, scale, offset) -> np.ndarray:
    """Half a step per input (amax / 254) and the float16 scale's relative 2^-11 on up to 127 steps (amax / 127 *
    127 * 2^-11 < amax / 254 * 0.13), times |w|; for Q4_1 also the float16 block sum's 2^-11 on up to 32 inputs."""
    rows, k = x.shape
    amax = np.abs(x.reshape(rows, k // BLOCK, BLOCK)).max(-1)  # [rows, nb]
    w_abs = np.abs(dense(q, scale, offset)).reshape(q.shape[0], k // BLOCK, BLOCK).sum(-1)  # [n, nb]
    bound = amax @ w_abs.T / 254 * 1.13
    if offset is not None:
        bound += (amax * 32 * 2.0**-11) @ np.abs(offset).T
    return bound


SHAPES = [(576, 576), (100, 96), (8, 32), (1000, 1536), (13, 64)]  # (n, k): 100, 13 and 1000 pad their last group


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("threads", [1, 2, 3])  # 3: uneven runs, and a thread the host preempts (2 cores)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_every_instruction_set_equals_the_pure_paths(kind: str, threads: int, levels: int):
    """One level (llama.cpp's arithmetic): within the activations' rounding of the float dot. Two (the default):
    within 1/200 of that, since the second level's step is at most 1/254 of the first's."""
    rng = np.random.default_rng(66)
    for isa in cpu_block_matmul.isas():
        cpu_block_matmul.configure(isa, threads)
        for n, k in SHAPES:
            q, scale, offset = blocks(n, k, kind == "q4_1", rng)
            w, d, m, code = cpu_block_matmul.pack(q, scale, offset)
            for rows in (1, 2, 7, 16, 64):
                x = rng.standard_normal((rows, k)).astype(np.float32)
                x[0, :BLOCK] = 0  # an all-zero block (scale 0)
                got = np.asarray(
                    jax.jit(cpu_block_matmul.matmul, static_argnums=(4, 5, 6))(x, w, d, m, code, n, levels)
                )
                assert got.shape == (rows, n)
                exact = emulated(x, q, scale, offset, levels)
                top = np.abs(exact).max()
                np.testing.assert_allclose(got, exact, rtol=0, atol=TIGHT * top, err_msg=f"{isa} {rows}x{k}x{n}")
                want = x.astype(np.float64) @ dense(q, scale, offset).T
                bound = rounding_bound(x, q, scale, offset) / (1 if levels == 1 else 200)
                assert (np.abs(got - want) <= bound + FLOAT_NOISE * top).all(), f"{isa} {rows}x{k}x{n}"


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_packing_keeps_every_value(kind: str):
    rng = np.random.default_rng(1)
    q, scale, offset = blocks(100, 96, kind == "q4_1", rng)
    w, d, m, code = cpu_block_matmul.pack(q, scale, offset)
    assert d.shape == (13, 3, 8) and code == (cpu_block_matmul.Q4_1 if kind == "q4_1" else cpu_block_matmul.Q8_0)
    assert w.nbytes == 13 * 8 * (48 if kind == "q4_1" else 96)  # Q4_1: two values a byte
    unpacked = np.asarray(cpu_block_matmul.unpack(jnp.asarray(w), jnp.asarray(d), jnp.asarray(m), code, 100))
    np.testing.assert_allclose(unpacked, dense(q, scale, offset), rtol=1e-6, atol=1e-7)


def quantized_weight(n: int, k: int, q4_1: bool, rng) -> QuantizedWeight:
    q, scale, offset = blocks(n, k, q4_1, rng)
    out, inp, nb = hax.Axis("out", n), hax.Axis("in", k), hax.Axis("in_blocks", k // BLOCK)
    return QuantizedWeight(
        hax.named(jnp.asarray(q), (out, inp)),
        hax.named(jnp.asarray(scale), (out, nb)),
        block=BLOCK,
        offset=None if offset is None else hax.named(jnp.asarray(offset), (out, nb)),
    )


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 200])  # 200: a prefill chunk, through the kernel as well
def test_the_weight_equals_xlas_loops(kind: str, rows: int, monkeypatch):
    """CpuBlockWeight (natively, then its pure-JAX fallback) against quantization.cpu_int8_matmul on the same blocks,
    named axes and all."""
    rng = np.random.default_rng(rows)
    qw = quantized_weight(100, 192, kind == "q4_1", rng)
    native = CpuBlockWeight.from_quantized(qw, contracted=1)
    x = hax.named(jnp.asarray(rng.standard_normal((rows, 192)), jnp.float32), ("token", "in"))
    want = cpu_int8_matmul(x, qw, "in")
    assert want is not None
    got = jax.jit(lambda x, w: w(x, "in"))(x, native)
    assert got.axes == want.axes
    xs = np.asarray(x.array, np.float64)
    q, scale = np.asarray(qw.weight.array), np.asarray(qw.scale.array)
    offset = None if qw.offset is None else np.asarray(qw.offset.array)
    bound = rounding_bound(xs, q, scale, offset) + FLOAT_NOISE * np.abs(np.asarray(want.array)).max()
    assert (np.abs(np.asarray(got.array) - np.asarray(want.array)) <= bound).all()
    monkeypatch.setattr(cpu_block_weight.cpu_block_matmul, "available", lambda: False)
    pure = jax.jit(lambda x, w: w(x, "in"))(x, native)
    np.testing.assert_allclose(np.asarray(pure.array), np.asarray(want.array), rtol=1e-4, atol=1e-4)


def test_threads_follow_the_hosts_cores(monkeypatch):
    monkeypatch.delenv("CAPSTAN_CPU_MATMUL_THREADS", raising=False)
    assert 1 <= cpu_block_matmul.host_threads() <= len(os.sched_getaffinity(0))
    monkeypatch.setenv("CAPSTAN_CPU_MATMUL_THREADS", "3")
    assert cpu_block_matmul.host_threads() == 3


def test_scales_beyond_float16_stay_on_xlas_path():
    """The kernel's layout keeps scales in float16 (GGUF's): a weight whose scales do not fit is refused by pack with
    a message, and cpu_layout keeps it on XLA's loops instead of multiplying by infinity."""
    rng = np.random.default_rng(3)
    q, scale, offset = blocks(16, 64, False, rng)
    with pytest.raises(ValueError, match="float16"):
        cpu_block_matmul.pack(q, scale * 1e8, offset)
    qw = quantized_weight(16, 64, False, rng)
    huge = QuantizedWeight(qw.weight, qw.scale * 1e8, block=BLOCK)
    assert cpu_layout._native(huge) is huge
    assert isinstance(cpu_layout._native(qw), CpuBlockWeight)
