"""The native CPU paged attention (kernels/cpu_paged_attention.py, runtime/kernels/cpu/paged_attention.cc) against
the plain-XLA reference (attention/reference.py): decode rows, a prefill chunk with its cached context, padding tokens,
sliding windows, soft-capping, a value scale, pages scattered through the cache, one thread and the pool, and what
the engine chooses on CPU."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.attention import HEADS_FIRST, choose_kernel
from capstan.runtime.attention.metadata import AttentionMetadata
from capstan.runtime.attention.reference import paged_attention
from capstan.runtime.kernels import cpu_block_matmul, cpu_paged_attention

TIGHT = 2e-6  # float32 sums in another order, on outputs of magnitude ~1

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or jax.default_backend() != "cpu",
    reason="the native kernels are x86-64 CPU only",
)


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_block_matmul.build()  # make setup builds it; here too, so the test runs on a tree set up before it existed
    assert cpu_paged_attention.available()
    yield


def step(rng, *, rows, tokens_per_row, context, kv_heads=3, group=3, head_dim=64, page=16, pages=160, max_pages=8):
    """A step of `rows` sequences, each with `tokens_per_row` new tokens after `context` cached ones, over pages
    scattered through the cache (page 0 left unused); then padding tokens up to a multiple of 8."""
    shape = (kv_heads, pages, page, head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(2))
    tables = rng.permutation(np.arange(1, pages))[: rows * max_pages].reshape(rows, max_pages).astype(np.int32)
    seq = np.repeat(np.arange(rows), tokens_per_row)
    pos = np.tile(np.arange(context, context + tokens_per_row), rows)
    pad = -len(seq) % 8
    seq, pos = np.concatenate([seq, np.zeros(pad, int)]), np.concatenate([pos, np.zeros(pad, int)])
    meta = AttentionMetadata(
        positions=jnp.asarray(pos, jnp.int32),
        slot_mapping=jnp.zeros(len(pos), jnp.int32),  # attention reads the pages as they are: no write here
        token_seq=jnp.asarray(seq, jnp.int32),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.full(rows, context + tokens_per_row, jnp.int32),
        decode=tokens_per_row == 1,
    )
    q = jnp.asarray(rng.standard_normal((len(pos), kv_heads, group, head_dim), np.float32))
    return q, k, v, meta


@pytest.mark.parametrize(
    "rows, tokens_per_row, context",
    [(1, 1, 0), (1, 1, 37), (16, 1, 100), (3, 1, 127), (1, 40, 0), (2, 24, 50), (1, 1, 127)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_gives_the_references_attention(rows, tokens_per_row, context, threads):
    cpu_block_matmul.configure(threads=threads)
    try:
        q, k, v, meta = step(np.random.default_rng(rows * 1000 + context), rows=rows, tokens_per_row=tokens_per_row,
                             context=context)  # fmt: skip
        got = jax.jit(lambda *a: cpu_paged_attention.paged_attention(*a, scale=0.125))(q, k, v, meta)
        want = paged_attention(q, k, v, meta, scale=0.125)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TIGHT, rtol=0)
    finally:
        cpu_block_matmul.configure()


@pytest.mark.parametrize("window, softcap, v_scale", [(8, None, 1.0), (1, None, 1.0), (None, 5.0, 1.0), (20, 3.0, 0.5)])
def test_windows_softcaps_and_value_scales_follow_the_reference(window, softcap, v_scale):
    q, k, v, meta = step(np.random.default_rng(7), rows=2, tokens_per_row=12, context=30)
    kw = dict(scale=0.3, window=window, softcap=softcap, k_scale=0.5, v_scale=v_scale)
    got = jax.jit(lambda *a: cpu_paged_attention.paged_attention(*a, **kw))(q, k, v, meta)
    np.testing.assert_allclose(np.asarray(got), np.asarray(paged_attention(q, k, v, meta, **kw)), atol=TIGHT, rtol=0)


def test_a_traced_window_is_read_at_run_time():
    q, k, v, meta = step(np.random.default_rng(3), rows=1, tokens_per_row=16, context=20)
    run = jax.jit(lambda w, *a: cpu_paged_attention.paged_attention(*a, scale=0.125, window=w))
    for window in (4, 30):
        want = paged_attention(q, k, v, meta, scale=0.125, window=window)
        np.testing.assert_allclose(np.asarray(run(jnp.int32(window), q, k, v, meta)), np.asarray(want), atol=TIGHT)


def test_rows_and_pages_out_of_range_read_nothing():
    """A token of a row past the block tables gets zeros; a table entry past the cache's pages masks its keys (the
    kernel never reads outside the cache), as if those keys were not there."""
    q, k, v, meta = step(np.random.default_rng(5), rows=2, tokens_per_row=1, context=40)
    seq = meta.token_seq.at[1].set(7)
    tables = meta.block_tables.at[0, 1].set(10_000).at[0, 2].set(-3)
    bad = AttentionMetadata(meta.positions, meta.slot_mapping, seq, tables, meta.seq_lens, decode=True)
    got = np.asarray(jax.jit(lambda *a: cpu_paged_attention.paged_attention(*a, scale=0.125))(q, k, v, bad))
    assert np.all(got[1] == 0)
    # row 0 without keys 16..47 (table entries 1 and 2): a softmax over the keys it kept
    pages = np.asarray(meta.block_tables[0])
    keys = [(pages[c // 16], c % 16) for c in range(41) if not 16 <= c < 48]
    kk = np.stack([np.asarray(k)[:, p, o] for p, o in keys], axis=1)  # [KVH, C, D]
    vv = np.stack([np.asarray(v)[:, p, o] for p, o in keys], axis=1)
    s = np.einsum("kgd,kcd->kgc", np.asarray(q[0]), kk) * 0.125
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("kgc,kcd->kgd", p / p.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(got[0], want, atol=1e-5)


def test_the_engine_chooses_the_kernel_for_float32_pages_on_cpu():
    step_shape = dict(batch=16, kv_heads=3, pages_per_seq=32, page_size=16, head_dim=64, window=None, softcap=0.0)
    assert choose_kernel("cpu", layout=HEADS_FIRST, decode=True, ragged=False, dtype=jnp.float32, **step_shape) == (
        "cpu_native"
    )
    for dtype, kv_dtype in ((jnp.bfloat16, None), (jnp.float32, jnp.float8_e4m3fn)):
        kernel = choose_kernel(
            "cpu", layout=HEADS_FIRST, decode=True, ragged=False, dtype=dtype, kv_dtype=kv_dtype, **step_shape
        )
        assert kernel == "chunked"
