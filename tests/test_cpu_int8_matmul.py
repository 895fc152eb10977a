"""quantization.cpu_int8_matmul, CPU INT8 weights multiplied without a float copy: each of its loops (one row, a
tiled loop for several rows, per row, dequantized) equals the dequantized weight's dot (float32 rounding)."""

from __future__ import annotations

import haliax as hax
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.models import quantization
from capstan.runtime.models.quantization import QuantizedWeight, cpu_int8_matmul

BLOCK = 32
Token, Out, In = hax.Axis("token", 1), hax.Axis("out", 1), hax.Axis("in", 1)


def weight(n: int, k: int, rng, offset: bool) -> QuantizedWeight:
    """GGUF-like blocks along k: Q4_1 (values 0-15, a scale and minimum per block) or Q8_0 (symmetric, no minimum)."""
    out, inp, blocks = Out.resize(n), In.resize(k), hax.Axis("in_blocks", k // BLOCK)
    q = rng.integers(0, 16, (n, k)) if offset else rng.integers(-127, 128, (n, k))
    scale = rng.uniform(0.001, 0.02, (n, k // BLOCK)).astype(np.float32)
    return QuantizedWeight(
        hax.named(jnp.asarray(q, jnp.int8), (out, inp)),
        hax.named(jnp.asarray(scale), (out, blocks)),
        block=BLOCK,
        offset=hax.named(jnp.asarray(-8 * scale), (out, blocks)) if offset else None,
    )


@pytest.mark.parametrize("offset", [True, False], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 64, 65])
@pytest.mark.parametrize("n", [192, 576, 4608, 100])  # 100: no tile divides it (the per-row loop)
def test_each_loop_equals_the_dequantized_dot(rows: int, n: int, offset: bool):
    rng = np.random.default_rng(rows * 1000 + n)
    k = 128
    w = weight(n, k, rng, offset)
    x = hax.named(jnp.asarray(rng.standard_normal((rows, k)), jnp.float32), (Token.resize(rows), In.resize(k)))
    got = cpu_int8_matmul(x, w, "in")
    assert got is not None
    want = np.asarray(x.array, np.float64) @ np.asarray(w.dequantize().array, np.float64).T
    assert got.axes == (Token.resize(rows), Out.resize(n))
    np.testing.assert_allclose(np.asarray(got.array), want, rtol=1e-4, atol=1e-4)


def test_tiles_divide_the_output_rows():
    assert quantization._cpu_tile(576) == 64
    assert quantization._cpu_tile(49152) == 768
    assert quantization._cpu_tile(4608) == 768
    assert quantization._cpu_tile(100) == 0
