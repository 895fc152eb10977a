"""Attention kernels against the reference on random inputs (the Pallas GPU kernels run interpreted on CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.attention import INVALID_SLOT, AttentionMetadata, chunked_attention, paged_attention, write_kv
from capstan.runtime.attention.gpu_decode import decode_attention


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
    tables = rng.permutation(num_pages)[:S * pages_per_seq].reshape(S, pages_per_seq).astype(np.int32)
    n_tokens = sum(n for _, n in chunks)
    T = T or n_tokens + 5  # padding tokens at the end
    positions, token_seq = np.zeros(T, np.int32), np.zeros(T, np.int32)
    seq_lens = np.zeros(S, np.int32)
    t = 0
    for r, (start, n) in enumerate(chunks):
        positions[t:t + n] = np.arange(start, start + n)
        token_seq[t:t + n] = r
        seq_lens[r] = start + n
        t += n
    blocks = query_blocks([(r, start, n) for r, (start, n) in enumerate(chunks)], T, S, G)
    meta = AttentionMetadata(positions=jnp.asarray(positions), slot_mapping=jnp.full(T, INVALID_SLOT, jnp.int32),
                             token_seq=jnp.asarray(token_seq), block_tables=jnp.asarray(tables),
                             seq_lens=jnp.asarray(seq_lens), query_blocks=jnp.asarray(blocks))
    q = jnp.asarray(rng.normal(size=(T, KVH, G, D)), dtype)
    return q, k, v, meta, n_tokens


RAGGED = [(0, 70), (37, 1), (100, 29), (5, 1), (0, 3), (150, 40)]  # fresh prompts, decode rows, chunks after context


@pytest.mark.parametrize("kw", [{}, {"window": 20}, {"softcap": 5.0}, {"G": 1, "D": 128}, {"G": 8, "KVH": 1}, {"G": 3}])
def test_pallas_ragged_kernel_matches_the_reference(kw):
    from capstan.runtime.attention.gpu_ragged import ragged_attention

    attn = {k: kw.pop(k) for k in ("window", "softcap") if k in kw}
    q, k, v, meta, n = random_ragged_batch(4, RAGGED, **kw)
    want = np.asarray(paged_attention(q, k, v, meta, scale=0.125, **attn))[:n]
    got = np.asarray(ragged_attention(q, k, v, meta, scale=0.125, interpret=INTERPRET, **attn))
    assert np.isfinite(got).all() and not got[n:].any()  # padding tokens come back as zeros
    assert rel_err(got[:n], want) < 1e-5


def test_pallas_ragged_kernel_in_bfloat16_and_on_decode_batches():
    from capstan.runtime.attention.gpu_ragged import ragged_attention

    q, k, v, meta, n = random_ragged_batch(5, RAGGED, dtype=jnp.bfloat16)
    want = np.asarray(paged_attention(q, k, v, meta, scale=0.125), np.float32)[:n]
    assert rel_err(np.asarray(ragged_attention(q, k, v, meta, scale=0.125, interpret=INTERPRET), np.float32)[:n],
                   want) < 2e-2  # bf16 inputs and probabilities: about 2**-8 relative per element
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
    beyond = np.concatenate([tables[r, (pos[r] // 128 + 1) * chunk_pages:] for r in range(len(pos))])
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
