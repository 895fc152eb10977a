"""Attention kernels against the reference on random inputs (the Pallas GPU kernel runs interpreted on CPU)."""
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.attention import INVALID_SLOT, AttentionMetadata, paged_attention, write_kv
from capstan.runtime.attention.gpu_decode import decode_attention


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def random_decode_batch(seed, S=5, KVH=2, G=4, D=64, page=16, pages_per_seq=10, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    num_pages = S * pages_per_seq + 3
    k = jnp.asarray(rng.normal(size=(KVH, num_pages, page, D)), dtype)
    v = jnp.asarray(rng.normal(size=(KVH, num_pages, page, D)), dtype)
    tables = rng.permutation(num_pages)[:S * pages_per_seq].reshape(S, pages_per_seq).astype(np.int32)
    positions = rng.integers(0, pages_per_seq * page, S).astype(np.int32)
    seq_lens = positions + 1
    seq_lens[-1] = 0  # a padding row
    meta = AttentionMetadata(positions=jnp.asarray(positions), slot_mapping=jnp.full(S, INVALID_SLOT, jnp.int32),
                             token_seq=jnp.arange(S, dtype=jnp.int32), block_tables=jnp.asarray(tables),
                             seq_lens=jnp.asarray(seq_lens), decode=True)
    q = jnp.asarray(rng.normal(size=(S, KVH, G, D)), dtype)
    return q, k, v, meta


@pytest.mark.parametrize("seed, pages_per_seq", [(0, 10), (1, 3), (2, 40)])  # 40: contexts split across blocks
def test_pallas_decode_kernel_matches_the_reference(seed, pages_per_seq):
    q, k, v, meta = random_decode_batch(seed, pages_per_seq=pages_per_seq)
    want = paged_attention(q, k, v, meta, scale=0.125)
    got = decode_attention(q, k, v, meta, scale=0.125, interpret=True)
    live = np.asarray(meta.seq_lens) > 0
    assert np.isfinite(np.asarray(got)[live]).all()
    assert rel_err(np.asarray(got)[live], np.asarray(want)[live]) < 1e-5


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
