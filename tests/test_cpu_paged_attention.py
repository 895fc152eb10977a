"""The native CPU paged attention (kernels/cpu_paged_attention.py, runtime/kernels/cpu/paged_attention.cc) against
the plain-XLA reference (attention/reference.py): decode rows, a prefill chunk with its cached context, padding tokens,
sliding windows, soft-capping, a value scale, pages scattered through the cache, one thread and the pool, and what
the engine chooses on CPU; and its fused call (rope, the K/V write and attention) against the unfused path."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.attention import HEADS_FIRST, choose_kernel
from capstan.runtime.attention.metadata import INVALID_SLOT, AttentionMetadata
from capstan.runtime.attention.reference import paged_attention, write_kv
from capstan.runtime.kernels import cpu_block_matmul, cpu_paged_attention
from capstan.runtime.models.rope import apply_rotary, rotary_tables

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


def unfused(qkv, cos, sin, k, v, meta, page, **kw):
    """models/layers.py's path without the fused call: rope on q and k, the K/V write, then the reference."""
    G = qkv.shape[2] - 2
    q = apply_rotary(qkv[:, :, :G], cos, sin)
    key = apply_rotary(qkv[:, :, G], cos, sin)
    k, v = write_kv(k, meta.slot_mapping, key, page), write_kv(v, meta.slot_mapping, qkv[:, :, G + 1], page)
    return paged_attention(q, k, v, meta, **kw), k, v


@pytest.mark.parametrize("rows, tokens_per_row, context", [(1, 1, 37), (16, 1, 100), (1, 40, 0), (2, 24, 50)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_write_and_attend_in_one_call_gives_the_unfused_paths_pages_and_attention(
    rows, tokens_per_row, context, threads
):
    """The step's new keys and values land in their slots (padding tokens' INVALID_SLOT nowhere), and every token
    attends over them, its own sequence's earlier new tokens included; the pages are written in place under jit with
    the caches donated, as the engine's step program does."""
    cpu_block_matmul.configure(threads=threads)
    try:
        rng = np.random.default_rng(rows * 100 + tokens_per_row)
        _, k, v, meta = step(rng, rows=rows, tokens_per_row=tokens_per_row, context=context)
        T, page = meta.positions.shape[0], 16
        tables, seq, pos = (np.asarray(a) for a in (meta.block_tables, meta.token_seq, meta.positions))
        slots = tables[seq, pos // page] * page + pos % page
        slots[rows * tokens_per_row :] = INVALID_SLOT  # the padding tokens
        meta = AttentionMetadata(meta.positions, jnp.asarray(slots, jnp.int32), meta.token_seq, meta.block_tables,
                                 meta.seq_lens, decode=meta.decode)  # fmt: skip
        qkv = jnp.asarray(rng.standard_normal((T, 3, 5, 64), np.float32))  # 3 kv heads, 3 queries each, then k, v
        inv_freq = 1.0 / (10000.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64))
        cos, sin = rotary_tables(jnp.asarray(inv_freq), meta.positions)
        want, want_k, want_v = unfused(qkv, cos, sin, k, v, meta, page, scale=0.125)
        fused = jax.jit(
            lambda qkv, cos, sin, k, v, meta: cpu_paged_attention.rope_write_attend(
                qkv, cos, sin, k, v, meta, scale=0.125
            ),
            donate_argnums=(3, 4),
        )
        got, got_k, got_v = fused(qkv, cos, sin, jnp.array(k), jnp.array(v), meta)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), atol=1e-6, rtol=0)
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    finally:
        cpu_block_matmul.configure()


def test_the_fused_call_keeps_windows_and_softcaps():
    rng = np.random.default_rng(11)
    _, k, v, meta = step(rng, rows=2, tokens_per_row=12, context=30)
    tables, seq, pos = (np.asarray(a) for a in (meta.block_tables, meta.token_seq, meta.positions))
    slots = (tables[seq, pos // 16] * 16 + pos % 16).astype(np.int32)
    slots[24:] = INVALID_SLOT
    meta = AttentionMetadata(meta.positions, jnp.asarray(slots), meta.token_seq, meta.block_tables, meta.seq_lens,
                             decode=False)  # fmt: skip
    qkv = jnp.asarray(rng.standard_normal((len(pos), 3, 5, 64), np.float32))
    cos, sin = rotary_tables(jnp.asarray(1.0 / (500.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64))), meta.positions)
    kw = dict(scale=0.3, window=8, softcap=5.0)
    want, _, _ = unfused(qkv, cos, sin, k, v, meta, 16, **kw)
    got, _, _ = jax.jit(lambda *a: cpu_paged_attention.rope_write_attend(*a, **kw))(qkv, cos, sin, k, v, meta)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
