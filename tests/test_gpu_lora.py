"""The fused LoRA kernel for a few tokens (runtime/kernels/gpu_lora.py), run in Pallas' interpreter on CPU: each of
the four projections' y + x @ A[slot] @ B[slot] against models/lora.py's dense way over every slot, with base rows
(slot -1) and mixed slots; and Triton's lowering of it for CUDA (built here, run by `bash benchmarks/gpu_suite.sh
lorakernel`)."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.kernels import gpu_lora
from capstan.runtime.models.layers import ModelAxes
from capstan.runtime.models.lora import LayerAdapters, LoRALayer, layer_shapes


class _Cfg:  # the sizes layer_shapes and ModelAxes read: a small Llama with grouped queries
    hidden_size, intermediate_size, head_dim, num_kv_heads, queries_per_kv, vocab_size = 64, 96, 16, 2, 2, 32


def _inputs(tokens: int, slots: int, rank: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    cfg, ax = _Cfg(), ModelAxes.of(_Cfg())  # type: ignore[arg-type]
    weights = LoRALayer(
        **{
            name: jnp.asarray(rng.normal(size=shape) / 4, dtype)
            for name, shape in layer_shapes(cfg, slots, rank).items()  # type: ignore[arg-type]
        }
    )
    row = rng.integers(-1, slots, size=tokens).astype(np.int32)
    row[0] = -1  # a base row always, and (below) at least two slots
    row[-1] = slots - 1
    T = hax.Axis("token", tokens)

    def named(*axes):
        return hax.named(jnp.asarray(rng.normal(size=tuple(a.size for a in axes)), dtype), axes)

    calls = {
        "qkv": (named(T, ax.Embed), named(T, ax.KVHeads, ax.QKV, ax.HeadSize)),
        "out": (named(T, ax.KVHeads, ax.QPerKV, ax.HeadSize), named(T, ax.Embed)),
        "gate_up": (named(T, ax.Embed), named(T, ax.GateUp, ax.Mlp)),
        "down": (named(T, ax.Mlp), named(T, ax.Embed)),
    }
    return LayerAdapters(weights, jnp.asarray(row)), calls, ax


@pytest.mark.parametrize(
    "tokens, slots, rank, dtype", [(1, 4, 8, "float32"), (5, 3, 16, "float32"), (16, 8, 16, "bfloat16")]
)
def test_the_kernel_adds_what_the_dense_way_adds(tokens, slots, rank, dtype, monkeypatch):
    adapters, calls, ax = _inputs(tokens, slots, rank, dtype, seed=tokens)
    dense = {name: getattr(adapters, name)(x, y, "token", ax) for name, (x, y) in calls.items()}
    monkeypatch.setattr(gpu_lora, "INTERPRET", jax.default_backend() != "gpu")  # on a GPU: compiled by Triton
    monkeypatch.setattr(gpu_lora, "MAX_TOKENS", 16)  # off by default until measured on a GPU
    assert gpu_lora.applies(tokens, rank, 64, 96)
    base = np.asarray(adapters.slots) < 0
    for name, (x, y) in calls.items():
        got = getattr(adapters, name)(x, y, "token", ax)
        assert got.axes == dense[name].axes == y.rearrange(got.axes).axes, name
        got, want = np.asarray(got.array, np.float32), np.asarray(dense[name].array, np.float32)
        tol = 1e-5 if dtype == "float32" else 3e-2
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)
        np.testing.assert_array_equal(got[base], np.asarray(y.rearrange(dense[name].axes).array, np.float32)[base])


def test_steps_beyond_the_limit_and_odd_ranks_take_the_dense_way(monkeypatch):
    monkeypatch.setattr(gpu_lora, "INTERPRET", True)
    monkeypatch.setattr(gpu_lora, "MAX_TOKENS", 16)
    assert not gpu_lora.applies(17, 16, 64, 96)
    assert not gpu_lora.applies(4, 12, 64, 96)  # Triton loads powers of two
    monkeypatch.setattr(gpu_lora, "MAX_TOKENS", 0)
    assert not gpu_lora.applies(1, 16, 64, 96)
    monkeypatch.setattr(gpu_lora, "INTERPRET", False)
    monkeypatch.setattr(gpu_lora, "MAX_TOKENS", 16)
    assert not gpu_lora.applies(1, 16, 64, 96, backend="cpu")


@pytest.mark.parametrize("summed, parts, k, n", [(True, 3, 2048, 3072), (False, 2, 2048, 8192), (True, 1, 8192, 2048)])
def test_triton_lowers_the_kernel_for_llama_1b_shapes(summed, parts, k, n):
    """What a GPU compiles: qkv, gate_up and down of Llama-3.2-1B at 16 tokens, 8 slots, rank 16 (lowered, not run)."""
    S = jax.ShapeDtypeStruct
    T, L, R, Q = 16, 8, 16, 1 if summed else parts
    args = (
        S((T, Q, n), jnp.bfloat16),
        S((T, k), jnp.bfloat16),
        S((L, parts, R, k), jnp.bfloat16),
        S((L, parts, R, n), jnp.bfloat16),
        S((T,), jnp.int32),
    )
    lowered = gpu_lora.lora_delta.trace(*args, summed=summed, interpret=False).lower(lowering_platforms=("cuda",))
    assert "lora_delta" in lowered.as_text()
