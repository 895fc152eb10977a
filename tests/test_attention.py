"""Attention kernels against the reference on random inputs (the Pallas GPU kernels run interpreted on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.attention import INVALID_SLOT, AttentionMetadata, chunked_attention, paged_attention, write_kv
from capstan.runtime.kernels.gpu_decode_attention import decode_attention

INTERPRET = jax.default_backend() != "gpu"  # compiled with Triton on a GPU
# JAX's decode kernel multiplies float32 in TF32 on GPUs (10-bit mantissas); ours and the reference use IEEE float32
DECODE_KERNEL_TOLERANCE = 1e-5 if INTERPRET else 3e-3


@pytest.fixture(autouse=True)
def ieee_float32():
    with jax.default_matmul_precision("float32"):  # the reference's einsums in full float32 on GPUs too
        yield


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def random_decode_batch(seed, S=5, KVH=2, G=4, D=64, page=16, pages_per_seq=10, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    num_pages = S * pages_per_seq + 3
    k = jnp.asarray(rng.normal(size=(KVH, num_pages, page, D)), dtype)
    v = jnp.asarray(rng.normal(size=(KVH, num_pages, page, D)), dtype)
    tables = rng.permutation(num_pages)[: S * pages_per_seq].reshape(S, pages_per_seq).astype(np.int32)
    positions = rng.integers(0, pages_per_seq * page, S).astype(np.int32)
    seq_lens = positions + 1
    seq_lens[-1] = 0  # a padding row
    meta = AttentionMetadata(
        positions=jnp.asarray(positions),
        slot_mapping=jnp.full(S, INVALID_SLOT, jnp.int32),
        token_seq=jnp.arange(S, dtype=jnp.int32),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens),
        decode=True,
    )
    q = jnp.asarray(rng.normal(size=(S, KVH, G, D)), dtype)
    return q, k, v, meta


@pytest.mark.parametrize("seed, pages_per_seq", [(0, 10), (1, 3), (2, 40)])  # 40: contexts split across blocks
def test_pallas_decode_kernel_matches_the_reference(seed, pages_per_seq):
    q, k, v, meta = random_decode_batch(seed, pages_per_seq=pages_per_seq)
    want = paged_attention(q, k, v, meta, scale=0.125)
    got = decode_attention(q, k, v, meta, scale=0.125, interpret=INTERPRET)
    live = np.asarray(meta.seq_lens) > 0
    assert np.isfinite(np.asarray(got)[live]).all()
    assert rel_err(np.asarray(got)[live], np.asarray(want)[live]) < DECODE_KERNEL_TOLERANCE


def test_reference_respects_causality_and_windows():
    q, k, v, meta = random_decode_batch(3, S=2)
    full = paged_attention(q, k, v, meta, scale=0.1)
    # keys after the query position must not matter: poison them
    pos = np.asarray(meta.positions)
    tables = np.asarray(meta.block_tables)
    k2 = np.array(k)
    for r in range(2):
        for p in range(pos[r] + 1, tables.shape[1] * 16):
            k2[:, tables[r, p // 16], p % 16] = 1e4
    assert rel_err(paged_attention(q, jnp.asarray(k2), v, meta, scale=0.1), full) < 1e-6
    windowed = paged_attention(q, k, v, meta, scale=0.1, window=1)  # only the query's own key
    own = np.stack([np.asarray(v)[:, tables[r, pos[r] // 16], pos[r] % 16] for r in range(2)])  # [S, KVH, D]
    np.testing.assert_allclose(np.asarray(windowed), np.broadcast_to(own[:, :, None], windowed.shape), rtol=1e-5)


def test_write_kv_scatters_to_pages_and_drops_padding():
    cache = jnp.zeros((3, 4, 8, 5))  # kv heads, pages, page size, head dim
    values = jnp.arange(2 * 3 * 5, dtype=jnp.float32).reshape(2, 3, 5) + 1
    slots = jnp.asarray([2 * 8 + 3, INVALID_SLOT], jnp.int32)
    out = write_kv(cache, slots, values, 8)
    np.testing.assert_array_equal(out[:, 2, 3], values[0])
    assert float(jnp.abs(out).sum()) == float(values[0].sum())


def random_ragged_batch(seed, chunks, KVH=2, G=4, D=64, page=16, pages_per_seq=12, T=None, dtype=jnp.float32):
    """chunks: (start position, tokens) per sequence; start > 0 means cached context before the chunk."""
    from capstan.runtime.attention import query_blocks

    rng = np.random.default_rng(seed)
    S = len(chunks) + 1  # one padding row
    num_pages = S * pages_per_seq + 3
    k = jnp.asarray(rng.normal(size=(KVH, num_pages, page, D)), dtype)
    v = jnp.asarray(rng.normal(size=(KVH, num_pages, page, D)), dtype)
    tables = rng.permutation(num_pages)[: S * pages_per_seq].reshape(S, pages_per_seq).astype(np.int32)
    n_tokens = sum(n for _, n in chunks)
    T = T or n_tokens + 5  # padding tokens at the end
    positions, token_seq = np.zeros(T, np.int32), np.zeros(T, np.int32)
    seq_lens = np.zeros(S, np.int32)
    t = 0
    for r, (start, n) in enumerate(chunks):
        positions[t : t + n] = np.arange(start, start + n)
        token_seq[t : t + n] = r
        seq_lens[r] = start + n
        t += n
    blocks = query_blocks([(r, start, n) for r, (start, n) in enumerate(chunks)], T, S, G)
    meta = AttentionMetadata(
        positions=jnp.asarray(positions),
        slot_mapping=jnp.full(T, INVALID_SLOT, jnp.int32),
        token_seq=jnp.asarray(token_seq),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens),
        query_blocks=jnp.asarray(blocks),
    )
    q = jnp.asarray(rng.normal(size=(T, KVH, G, D)), dtype)
    return q, k, v, meta, n_tokens


RAGGED = [(0, 70), (37, 1), (100, 29), (5, 1), (0, 3), (150, 40)]  # fresh prompts, decode rows, chunks after context


@pytest.mark.parametrize("kw", [{}, {"window": 20}, {"softcap": 5.0}, {"G": 1, "D": 128}, {"G": 8, "KVH": 1}, {"G": 3}])
def test_pallas_ragged_kernel_matches_the_reference(kw):
    from capstan.runtime.kernels.gpu_ragged_attention import ragged_attention

    attn = {k: kw.pop(k) for k in ("window", "softcap") if k in kw}
    q, k, v, meta, n = random_ragged_batch(4, RAGGED, **kw)
    want = np.asarray(paged_attention(q, k, v, meta, scale=0.125, **attn))[:n]
    got = np.asarray(ragged_attention(q, k, v, meta, scale=0.125, interpret=INTERPRET, **attn))
    assert np.isfinite(got).all() and not got[n:].any()  # padding tokens come back as zeros
    assert rel_err(got[:n], want) < 1e-5


def test_pallas_ragged_kernel_in_bfloat16_and_on_decode_batches():
    from capstan.runtime.kernels.gpu_ragged_attention import ragged_attention

    q, k, v, meta, n = random_ragged_batch(5, RAGGED, dtype=jnp.bfloat16)
    want = np.asarray(paged_attention(q, k, v, meta, scale=0.125), np.float32)[:n]
    assert (
        rel_err(np.asarray(ragged_attention(q, k, v, meta, scale=0.125, interpret=INTERPRET), np.float32)[:n], want)
        < 2e-2
    )  # bf16 inputs and probabilities: about 2**-8 relative per element
    q, k, v, meta = random_decode_batch(6)  # no query blocks: built on the device from the decode rows
    live = np.asarray(meta.seq_lens) > 0
    want = np.asarray(paged_attention(q, k, v, meta, scale=0.125, window=33))[live]
    got = np.asarray(ragged_attention(q, k, v, meta, scale=0.125, window=33, interpret=INTERPRET))[live]
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("kw", [{}, {"window": 20}, {"softcap": 5.0}, {"G": 1, "D": 128}, {"page": 4}, {"page": 256}])
def test_chunked_attention_matches_the_reference(kw):
    attn = {k: kw.pop(k) for k in ("window", "softcap") if k in kw}
    q, k, v, meta, n = random_ragged_batch(7, RAGGED, pages_per_seq=max(1, 200 // kw.get("page", 16)) + 1, **kw)
    want = np.asarray(paged_attention(q, k, v, meta, scale=0.125, **attn))[:n]
    got = np.asarray(chunked_attention(q, k, v, meta, scale=0.125, **attn))
    assert np.isfinite(got).all()
    assert rel_err(got[:n], want) < 1e-5
    q, k, v, meta = random_decode_batch(8, pages_per_seq=40)
    live = np.asarray(meta.seq_lens) > 0
    want = np.asarray(paged_attention(q, k, v, meta, scale=0.125, **attn))[live]
    assert rel_err(np.asarray(chunked_attention(q, k, v, meta, scale=0.125, **attn))[live], want) < 1e-5


def test_chunked_attention_reads_no_key_past_each_tokens_context():
    q, k, v, meta = random_decode_batch(9, pages_per_seq=64)  # a 1,024-key block table; 5 rows: a group each
    chunk_pages = 128 // 16  # KEYS_PER_CHUNK over the page size
    tables, pos = np.asarray(meta.block_tables), np.asarray(meta.positions)
    beyond = np.concatenate([tables[r, (pos[r] // 128 + 1) * chunk_pages :] for r in range(len(pos))])
    assert beyond.size
    k2, v2 = np.array(k), np.array(v)
    k2[:, beyond], v2[:, beyond] = np.nan, np.nan  # the reference would turn these into NaN outputs
    got = np.asarray(chunked_attention(q, jnp.asarray(k2), jnp.asarray(v2), meta, scale=0.125))
    want = np.asarray(paged_attention(q, k, v, meta, scale=0.125))
    assert np.isfinite(got).all() and rel_err(got, want) < 1e-5


def test_chunked_attention_in_bfloat16():
    q, k, v, meta, n = random_ragged_batch(10, RAGGED, dtype=jnp.bfloat16)
    want = np.asarray(paged_attention(q, k, v, meta, scale=0.125), np.float32)[:n]
    got = np.asarray(chunked_attention(q, k, v, meta, scale=0.125), np.float32)[:n]
    assert rel_err(got, want) < 2e-2  # bf16 probabilities, normalised at the end instead of before the product


def fused_decode_case(seed, S=5, KVH=2, G=4, D=64, page=16, pages_per_seq=10, dtype=jnp.float32, norms=False):
    """A decode step as the QKV matmul leaves it: qkv [S, KVH, G + 2, D], rope tables, caches, and each row's slot
    at its position (the last row padding: no length, INVALID_SLOT)."""
    from capstan.runtime.models.rope import rotary_tables

    _, k, v, meta = random_decode_batch(
        seed, S=S, KVH=KVH, G=G, D=D, page=page, pages_per_seq=pages_per_seq, dtype=dtype
    )
    rng = np.random.default_rng(seed + 100)
    pos, tables = np.asarray(meta.positions), np.asarray(meta.block_tables)
    slots = tables[np.arange(S), pos // page] * page + pos % page
    slots[-1] = INVALID_SLOT
    meta = AttentionMetadata(
        positions=meta.positions,
        slot_mapping=jnp.asarray(slots, jnp.int32),
        token_seq=meta.token_seq,
        block_tables=meta.block_tables,
        seq_lens=meta.seq_lens,
        decode=True,
    )
    qkv = jnp.asarray(rng.normal(size=(S, KVH, G + 2, D)), dtype)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, D, 2) / D))
    cos, sin = rotary_tables(jnp.asarray(inv_freq, jnp.float32), meta.positions)
    q_norm = jnp.asarray(rng.normal(1.0, 0.3, size=D), dtype) if norms else None
    k_norm = jnp.asarray(rng.normal(1.0, 0.3, size=D), dtype) if norms else None
    return qkv, cos, sin, k, v, meta, q_norm, k_norm


def reference_decode_step(
    qkv, cos, sin, k_cache, v_cache, meta, scale, q_norm, k_norm, eps, one_plus, k_scale=1.0, v_scale=1.0
):
    """What the layers do without the fused kernel: norms, rope, write_kv, then the reference attention."""
    from capstan.runtime.models.rope import apply_rotary

    G = qkv.shape[2] - 2
    q, k, v = qkv[:, :, :G], qkv[:, :, G], qkv[:, :, G + 1]

    def norm(x, w):  # layers.rms_norm on plain arrays
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype) if one_plus else w * normed.astype(x.dtype)

    if q_norm is not None:
        q, k = norm(q, q_norm), norm(k, k_norm)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    page = k_cache.shape[2]
    k_cache = write_kv(k_cache, meta.slot_mapping, k, page, k_scale)
    v_cache = write_kv(v_cache, meta.slot_mapping, v, page, v_scale)
    out = paged_attention(q, k_cache, v_cache, meta, scale=scale, k_scale=k_scale, v_scale=v_scale)
    return out, k_cache, v_cache


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"pages_per_seq": 3},
        {"pages_per_seq": 40},  # 40: contexts split across programs
        {"G": 1, "D": 128},
        {"G": 2, "D": 16, "KVH": 4},
        {"G": 8, "KVH": 1},
        {"G": 3},
        {"page": 4, "pages_per_seq": 24},
        {"norms": True},
        {"norms": True, "one_plus": True},
        {"dtype": jnp.bfloat16},
        {"dtype": jnp.bfloat16, "norms": True},
    ],
)
def test_fused_decode_kernel_matches_norms_rope_write_and_attention(kw):
    from capstan.runtime.kernels.gpu_fused_decode_attention import fused_decode_attention

    kw = dict(kw)
    one_plus = kw.pop("one_plus", False)
    qkv, cos, sin, k, v, meta, q_norm, k_norm = fused_decode_case(7, **kw)
    args = dict(scale=0.125, q_norm=q_norm, k_norm=k_norm, eps=1e-6, one_plus=one_plus)
    want, want_k, want_v = reference_decode_step(
        qkv, cos, sin, k, v, meta, args["scale"], q_norm, k_norm, args["eps"], one_plus
    )
    got, got_k, got_v = fused_decode_attention(qkv, cos, sin, k, v, meta, interpret=INTERPRET, **args)
    live = np.asarray(meta.seq_lens) > 0
    assert np.isfinite(np.asarray(got, np.float32)[live]).all()
    bf16 = qkv.dtype == jnp.bfloat16
    assert rel_err(np.asarray(got, np.float32)[live], np.asarray(want, np.float32)[live]) < (
        2e-2 if bf16 else DECODE_KERNEL_TOLERANCE
    )
    # the step's K/V land in their slots (rope in float32 then rounded once: within a bf16 ulp of the reference's
    # bf16 arithmetic), and nothing else in the caches moves
    slots = np.asarray(meta.slot_mapping)[live]
    page = k.shape[2]
    for got_c, want_c, before in ((got_k, want_k, k), (got_v, want_v, v)):
        got_c, want_c, before = (np.asarray(a, np.float32) for a in (got_c, want_c, before))
        np.testing.assert_allclose(
            got_c[:, slots // page, slots % page],
            want_c[:, slots // page, slots % page],
            rtol=1e-2 if bf16 else 1e-5,
            atol=1e-2 if bf16 else 1e-5,
        )
        untouched = np.ones(got_c.shape[1:3], bool)
        untouched[slots // page, slots % page] = False
        np.testing.assert_array_equal(got_c[:, untouched], before[:, untouched])


def test_fused_decode_kernel_on_a_splitting_batch_of_one():
    """One sequence of a long context: the split-context path and the first split's write."""
    from capstan.runtime.kernels.gpu_fused_decode_attention import fused_decode_attention

    qkv, cos, sin, k, v, meta, _, _ = fused_decode_case(11, S=2, pages_per_seq=64)
    want, want_k, _ = reference_decode_step(qkv, cos, sin, k, v, meta, 0.1, None, None, 0.0, False)
    for splits in (1, 4, 8):
        got, got_k, _ = fused_decode_attention(
            qkv, cos, sin, k, v, meta, scale=0.1, interpret=INTERPRET, k_splits=splits
        )
        assert rel_err(np.asarray(got)[:1], np.asarray(want)[:1]) < DECODE_KERNEL_TOLERANCE, splits
        np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_decode_kernel_adds_each_rows_adapter_delta_to_q_k_and_v(dtype):
    """lora=(h, b, slot): the kernel adds h @ b[slot] to each row's q, k and v before norms and rope, rounded as the
    layers round y + delta; a base row (h zeros) is untouched; contexts split or not."""
    from capstan.runtime.kernels.gpu_fused_decode_attention import fused_decode_attention

    qkv, cos, sin, k, v, meta, q_norm, k_norm = fused_decode_case(21, S=4, pages_per_seq=40, dtype=dtype, norms=True)
    S, KVH, rows, D = qkv.shape
    rng = np.random.default_rng(22)
    J, slots = 6, 3
    h = rng.normal(size=(S, J)).astype(np.float32)
    h[1] = 0.0  # a base row
    b = jnp.asarray(rng.normal(size=(slots, J, KVH, rows, D)) * 0.5, dtype)
    slot = jnp.asarray([2, 0, 1, 2], jnp.int32)
    delta = jnp.einsum("sj,sjkrd->skrd", jnp.asarray(h), b[slot].astype(jnp.float32))
    with_delta = (qkv.astype(jnp.float32) + delta.astype(dtype).astype(jnp.float32)).astype(dtype)
    args = dict(scale=0.125, q_norm=q_norm, k_norm=k_norm, eps=1e-6, one_plus=False)
    want, want_k, want_v = reference_decode_step(with_delta, cos, sin, k, v, meta, 0.125, q_norm, k_norm, 1e-6, False)
    live = np.asarray(meta.seq_lens) > 0
    slots_written = np.asarray(meta.slot_mapping)[live]
    page = k.shape[2]
    tol = 2e-2 if dtype == jnp.bfloat16 else DECODE_KERNEL_TOLERANCE
    for splits in (1, 4):
        got, got_k, got_v = fused_decode_attention(
            qkv, cos, sin, k, v, meta, interpret=INTERPRET, k_splits=splits, lora=(jnp.asarray(h), b, slot), **args
        )
        assert rel_err(np.asarray(got, np.float32)[live], np.asarray(want, np.float32)[live]) < tol, splits
        for got_c, want_c in ((got_k, want_k), (got_v, want_v)):
            got_c, want_c = np.asarray(got_c, np.float32), np.asarray(want_c, np.float32)
            np.testing.assert_allclose(
                got_c[:, slots_written // page, slots_written % page],
                want_c[:, slots_written // page, slots_written % page],
                rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5,
                atol=1e-2 if dtype == jnp.bfloat16 else 1e-5,
            )
    # and the delta matters: without it the output is another
    plain, _, _ = fused_decode_attention(qkv, cos, sin, k, v, meta, interpret=INTERPRET, k_splits=4, **args)
    assert rel_err(np.asarray(plain, np.float32)[[0, 2]], np.asarray(want, np.float32)[[0, 2]]) > 0.05
    np.testing.assert_allclose(np.asarray(plain, np.float32)[1], np.asarray(got, np.float32)[1], rtol=1e-5, atol=1e-5)


# FP8 pages (--kv-cache-dtype fp8): non-unit scales, so a reader that drops or misplaces one is far off
K_SCALE, V_SCALE = 0.03, 0.07


def as_fp8(k, v):
    """Random pages as an FP8 cache stores them (kv_quantization.store), with K_SCALE and V_SCALE."""
    from capstan.runtime.attention.kv_quantization import FP8, store

    return store(k, FP8, K_SCALE), store(v, FP8, V_SCALE)


def dequantized(pages, scale):
    return pages.astype(jnp.float32) * scale


def test_fp8_store_clips_to_its_range_and_round_trips_within_e4m3s_step():
    from capstan.runtime.attention.kv_quantization import FP8, FP8_MAX, cache_dtype, store

    x = jnp.asarray(np.random.default_rng(0).normal(size=4096) * 3, jnp.float32).at[:2].set(jnp.asarray([1e6, -1e6]))
    stored = store(x, FP8, 0.05)
    assert stored.dtype == FP8 and np.isfinite(np.asarray(stored.astype(jnp.float32))).all()  # no NaN past 448
    np.testing.assert_array_equal(np.asarray(stored[:2].astype(jnp.float32)), [FP8_MAX, -FP8_MAX])
    back, want = np.asarray(dequantized(stored[2:], 0.05)), np.asarray(x[2:])
    # 3 mantissa bits: half a step is 2^-4 of the value in e4m3's normal range, and 2^-10 x scale in its subnormals
    assert np.all(np.abs(back - want) <= np.maximum(np.abs(want) * 2.0**-4, 0.05 * 2.0**-10) + 1e-7)
    assert store(x, jnp.bfloat16, 0.05).dtype == jnp.bfloat16  # other dtypes: cast, no scale
    np.testing.assert_array_equal(np.asarray(store(x, jnp.bfloat16, 0.05)), np.asarray(x.astype(jnp.bfloat16)))
    assert cache_dtype("auto", jnp.float32) == jnp.float32 and cache_dtype("fp8", jnp.bfloat16) == FP8
    assert cache_dtype("fp8_e4m3", jnp.float32) == FP8 and cache_dtype("bfloat16", jnp.float32) == jnp.bfloat16


def test_config_and_attention_name_the_same_kv_cache_dtypes():
    from capstan.runtime.attention.kv_quantization import KV_CACHE_DTYPES
    from capstan.runtime.config import KV_CACHE_DTYPES as NAMES

    assert set(NAMES) == {"auto", *KV_CACHE_DTYPES}


def test_reference_over_fp8_pages_is_attention_over_their_dequantized_values():
    """The definition: FP8 pages times their scales, attended in float32 (reference and chunked path alike)."""
    q, k, v, meta, n = random_ragged_batch(12, RAGGED)
    k8, v8 = as_fp8(k, v)
    want = np.asarray(paged_attention(q, dequantized(k8, K_SCALE), dequantized(v8, V_SCALE), meta, scale=0.125))[:n]
    got = np.asarray(paged_attention(q, k8, v8, meta, scale=0.125, k_scale=K_SCALE, v_scale=V_SCALE))[:n]
    assert rel_err(got, want) < 1e-6
    chunked = chunked_attention(q, k8, v8, meta, scale=0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(np.asarray(chunked)[:n], want) < 1e-5
    exact = np.asarray(paged_attention(q, k, v, meta, scale=0.125))[:n]
    assert 1e-3 < rel_err(got, exact) < 0.1  # e4m3's rounding shows, and stays small


def test_write_kv_stores_fp8_divided_by_its_scale():
    from capstan.runtime.attention.kv_quantization import FP8

    cache = jnp.zeros((3, 4, 8, 5), FP8)
    values = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 5)), jnp.float32)
    out = write_kv(cache, jnp.asarray([2 * 8 + 3, INVALID_SLOT], jnp.int32), values, 8, 0.25)
    assert out.dtype == FP8
    np.testing.assert_array_equal(
        np.asarray(out[:, 2, 3].astype(jnp.float32)), np.asarray((values[0] / 0.25).astype(FP8).astype(jnp.float32))
    )
    assert float(jnp.abs(out.astype(jnp.float32)).sum()) == float(jnp.abs(out[:, 2, 3].astype(jnp.float32)).sum())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernels_read_fp8_pages_as_the_reference_does(dtype):
    """The ragged and JAX's decode kernel over FP8 pages with non-unit scales, against the reference over the same
    pages: float32 queries to IEEE precision (FP8 upcasts exactly), bf16 ones within bf16's rounding."""
    from capstan.runtime.kernels.gpu_ragged_attention import ragged_attention

    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    q, k, v, meta, n = random_ragged_batch(13, RAGGED, dtype=dtype)
    k8, v8 = as_fp8(k, v)
    want = np.asarray(paged_attention(q, k8, v8, meta, scale=0.125, **scales), np.float32)[:n]
    got = np.asarray(ragged_attention(q, k8, v8, meta, scale=0.125, interpret=INTERPRET, **scales), np.float32)
    assert np.isfinite(got).all() and rel_err(got[:n], want) < tolerance
    q, k, v, meta = random_decode_batch(14, pages_per_seq=40, dtype=dtype)
    k8, v8 = as_fp8(k, v)
    live = np.asarray(meta.seq_lens) > 0
    want = np.asarray(paged_attention(q, k8, v8, meta, scale=0.125, **scales), np.float32)[live]
    got = np.asarray(ragged_attention(q, k8, v8, meta, scale=0.125, interpret=INTERPRET, **scales), np.float32)
    assert rel_err(got[live], want) < tolerance
    if dtype == jnp.bfloat16:  # JAX's decode kernel serves bf16 (its float32 dots are TF32)
        got = np.asarray(decode_attention(q, k8, v8, meta, scale=0.125, interpret=INTERPRET, **scales), np.float32)
        assert np.isfinite(got[live]).all() and rel_err(got[live], want) < tolerance


@pytest.mark.parametrize("kw", [{}, {"dtype": jnp.bfloat16, "norms": True}, {"pages_per_seq": 40}])
def test_fused_decode_kernel_writes_and_reads_fp8_pages(kw):
    """The fused kernel quantizes the step's own K/V as write_kv does (the same bytes land in the pages), attends
    them as stored, and reads the cached context's FP8 pages with their scales: the reference step's result."""
    from capstan.runtime.kernels.gpu_fused_decode_attention import fused_decode_attention

    qkv, cos, sin, k, v, meta, q_norm, k_norm = fused_decode_case(15, **kw)
    k8, v8 = as_fp8(k, v)
    args = dict(scale=0.125, q_norm=q_norm, k_norm=k_norm, eps=1e-6, one_plus=False)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    want, want_k, want_v = reference_decode_step(
        qkv, cos, sin, k8, v8, meta, 0.125, q_norm, k_norm, 1e-6, False, **scales
    )
    got, got_k, got_v = fused_decode_attention(qkv, cos, sin, k8, v8, meta, interpret=INTERPRET, **args, **scales)
    live = np.asarray(meta.seq_lens) > 0
    bf16 = qkv.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32)[live], np.asarray(want, np.float32)[live]
    assert np.isfinite(got).all() and rel_err(got, want) < (2e-2 if bf16 else DECODE_KERNEL_TOLERANCE)
    assert got_k.dtype == got_v.dtype == k8.dtype
    slots, page = np.asarray(meta.slot_mapping)[live], k.shape[2]
    for got_c, want_c in ((got_k, want_k), (got_v, want_v)):
        got_c, want_c = (np.asarray(a.astype(jnp.float32)) for a in (got_c, want_c))
        # the same bytes but where rope rounds differently (float32 once against the reference's bf16 arithmetic,
        # or a GPU's float32 against the CPU's) and crosses an e4m3 rounding boundary: one e4m3 step at most
        np.testing.assert_allclose(got_c, want_c, rtol=2.0**-3, atol=2.0**-6)
        assert (got_c == want_c).mean() > (0.9 if bf16 else 0.99)
        assert np.abs(got_c[:, slots // page, slots % page]).sum() > 0
