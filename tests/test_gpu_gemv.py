"""The GEMV kernel for a decode step's tokens (runtime/kernels/gpu_gemv.py), run in Pallas' interpreter on CPU: its
sums against numpy's, and the golden models decoded through it give the logits of XLA's dots (`bash
benchmarks/gpu_suite.sh gemv` runs the same tests compiled by Triton)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden import CASES, GOLDEN, greedy_agreement_length, reference
from test_models import PAGE, _fresh_cache, _run

from capstan.runtime.kernels import gpu_gemv
from capstan.runtime.models.loader import load_model
from capstan.runtime.models.quantization import QuantizedWeight, dequantize_rows, quantize_blocks, quantize_rows


@pytest.mark.parametrize(
    "rows, n, k, splits",
    [
        (1, 128, 1024, None),
        (5, 64, 384, None),
        (16, 96, 160, 1),
        (3, 256, 2048, 4),
        (40, 64, 256, None),
        (130, 32, 256, 2),
    ],
)
@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float8_e4m3fn", "int8", "q8_0"])
@pytest.mark.parametrize("reduce", [False, True])
def test_kernel_sums_as_numpy_does(rows, n, k, splits, stored, reduce):
    rng = np.random.default_rng(rows * n)
    x = rng.normal(size=(rows, k)).astype(np.float32)
    block = 32 if stored == "q8_0" else 0
    if stored in ("float32", "bfloat16"):
        w, scale = jnp.asarray(rng.normal(size=(n, k)), stored), None
        dense = np.asarray(w, np.float32)
    elif block:  # GGUF Q8_0: a scale per 32 inputs of a row
        q = quantize_blocks(rng.normal(size=(n, k)), block)
        w, scale, dense = q.values, q.scale, np.asarray(dequantize_rows(q))
    else:
        q = quantize_rows(rng.normal(size=(n, k)), "fp8" if stored == "float8_e4m3fn" else "int8")
        w, scale, dense = q.values, q.scale, np.asarray(dequantize_rows(q))
    dtype = jnp.float32 if stored == "float32" else jnp.bfloat16
    xs = jnp.asarray(x, dtype)
    got = np.asarray(gpu_gemv.gemv(xs, w, scale, block=block, splits=splits, reduce=reduce), np.float32)
    want = np.asarray(xs, np.float32) @ dense.T
    assert got.shape == (rows, n)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16's output rounding
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_it_takes_few_rows_and_sizes_triton_can_tile(monkeypatch):
    monkeypatch.setattr(gpu_gemv, "MODE", "1")
    assert gpu_gemv.applies(1, 4096, 6144, jnp.bfloat16, backend="gpu")
    assert gpu_gemv.applies(gpu_gemv.MAX_ROWS, 160, 320, jnp.int8, backend="gpu")
    assert not gpu_gemv.applies(gpu_gemv.MAX_ROWS + 1, 4096, 6144, jnp.int8, backend="gpu")  # a GEMM: XLA's
    assert not gpu_gemv.applies(1, 4104, 6144, jnp.int8, backend="gpu")  # no power-of-two slice divides the inputs
    assert not gpu_gemv.applies(1, 4096, 6150, jnp.int8, backend="gpu")
    assert not gpu_gemv.applies(1, 4096, 6144, jnp.int8, backend="cpu")
    assert not gpu_gemv.applies(1, 4096, 6144, jnp.int8, block=24, backend="gpu")  # blocks must tile a slice
    monkeypatch.setattr(gpu_gemv, "MODE", "q8_0")  # the default: GGUF blocks, which XLA dequantizes every step
    assert gpu_gemv.applies(1, 4096, 6144, jnp.int8, block=32, backend="gpu")
    assert gpu_gemv.applies(gpu_gemv.Q8_0_MAX_ROWS, 4096, 6144, jnp.int8, block=32, backend="gpu")  # a batch's decode
    assert not gpu_gemv.applies(gpu_gemv.Q8_0_MAX_ROWS + 1, 4096, 6144, jnp.int8, block=32, backend="gpu")
    assert not gpu_gemv.applies(1, 4096, 6144, jnp.int8, backend="gpu")
    assert not gpu_gemv.applies(1, 4096, 6144, jnp.bfloat16, backend="gpu")


def test_split_rule_fills_the_gpu_with_divisors_of_the_steps():
    assert gpu_gemv._splits(n_blocks=448, k_steps=8) == 1  # gate_up of Llama-3-8B: enough programs already
    assert gpu_gemv._splits(n_blocks=64, k_steps=28) == 4  # its down projection: 14336 inputs in 28 slices
    assert gpu_gemv._splits(n_blocks=1, k_steps=3) == 3


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(gpu_gemv, "MODE", "interpret")


@pytest.mark.parametrize(
    "case, method",
    [(c, None) for c in CASES]
    + [("llama-s11", "fp8"), ("qwen3-s13", "int8"), ("qwen3-s13", "q8_0"), ("llama-s11", "q8_0")],
)
def test_decoding_through_the_kernel_matches_decoding_without_it(case, method, interpreted, monkeypatch, tmp_path):
    """A golden checkpoint's greedy decode, one token a step (every linear layer in the kernel), gives the logits
    of the same model through XLA's dots; and float32's greedy continuation is transformers'."""
    ref = reference(case)
    prompt, cont = ref["prompts"][0], ref["greedy_continuations"][0]
    if method == "q8_0":  # a GGUF file's Q8_0 blocks, kept as the file has them
        from gguf_files import write_gguf

        from capstan.runtime.models.gguf_checkpoint import load_gguf_model

        model = load_gguf_model(write_gguf(GOLDEN / case, tmp_path / "q.gguf", q8_0=True), jnp.float32, "none")
    else:
        model = load_model(GOLDEN / case, "float32", method)
    pages = list(range(1, 1 + 160 // PAGE))
    traced = []  # the kernel's uses as the steps are traced: one per linear layer of a one-token step
    real = gpu_gemv.gemv
    monkeypatch.setattr(gpu_gemv, "gemv", lambda *a, **k: traced.append(a[1].shape) or real(*a, **k))

    def decode(kernel: bool):
        gpu_gemv.MODE = ("1" if jax.default_backend() == "gpu" else "interpret") if kernel else "0"
        jax.clear_caches()
        kv = _fresh_cache(model, 1 + len(pages))
        logits, kv = _run(model, kv, prompt, 0, pages, 160)  # the prompt's 160-row step: XLA's dots
        out, steps = [int(np.argmax(logits[-1]))], []
        while len(out) < min(len(cont), 6):
            logits, kv = _run(model, kv, [out[-1]], len(prompt) + len(out) - 1, pages, 1)
            steps.append(logits[-1])
            out.append(int(np.argmax(logits[-1])))
        return out, np.stack(steps)

    out, with_kernel = decode(True)
    assert len(traced) >= 4 * model.cfg.num_layers  # qkv, o, gate_up and down of every layer
    traced.clear()
    _, without = decode(False)
    assert not traced
    np.testing.assert_allclose(with_kernel, without, rtol=1e-4, atol=1e-4 * np.abs(without).max())
    if method is None:
        owed = min(greedy_agreement_length(ref, 0), len(out))
        assert out[:owed] == cont[:owed]
    if method:
        down = model.layers[0].mlp.down_proj
        assert isinstance(down, QuantizedWeight) and down.block == (32 if method == "q8_0" else 0)
