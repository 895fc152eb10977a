"""Paged attention kernels against the plain-XLA reference on one layer of a Llama-3.2-1B-shaped cache.

python benchmarks/attention_kernels.py [--dtype bfloat16]
prints milliseconds per call for a decode batch (256 rows) and for mixed prefill steps (2048 tokens), with the
kernels' relative error against the reference. On CPU the kernels run interpreted (correct, not fast)."""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from capstan.runtime.attention import INVALID_SLOT, AttentionMetadata, paged_attention, query_blocks
from capstan.runtime.attention.gpu_decode import decode_attention
from capstan.runtime.attention.gpu_ragged import ragged_attention
from timing import median_ms


def batch(chunks, *, KVH, G, D, page, max_len, dtype, decode=False, seed=0):
    """chunks: (first position, tokens) per sequence; all of a sequence's keys up to its last token are cached."""
    rng = np.random.default_rng(seed)
    S, P = len(chunks), -(-max_len // page)
    k = jnp.asarray(rng.normal(size=(KVH, S * P, page, D)), dtype)
    v = jnp.asarray(rng.normal(size=(KVH, S * P, page, D)), dtype)
    tables = rng.permutation(S * P).reshape(S, P).astype(np.int32)
    T = sum(n for _, n in chunks)
    positions = np.concatenate([np.arange(s, s + n) for s, n in chunks]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, r) for r, (_, n) in enumerate(chunks)]).astype(np.int32)
    meta = AttentionMetadata(
        positions=jnp.asarray(positions), slot_mapping=jnp.full(T, INVALID_SLOT, jnp.int32),
        token_seq=jnp.asarray(token_seq), block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray([s + n for s, n in chunks], jnp.int32), decode=decode,
        query_blocks=None if decode else jnp.asarray(query_blocks([(r, s, n) for r, (s, n) in enumerate(chunks)], T, S, G)))
    q = jnp.asarray(rng.normal(size=(T, KVH, G, D)), dtype)
    return q, k, v, meta


def timed(fn, *args) -> float:
    return median_ms(fn, *args, repeats=20 if jax.default_backend() == "gpu" else 1)  # interpreted on CPU: slow


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    dtype = jnp.dtype(a.dtype)
    interpret = jax.default_backend() != "gpu"
    shape = dict(KVH=8, G=4, D=64, page=16, max_len=528, dtype=dtype)  # Llama-3.2-1B, 512 + 16 tokens of context
    scale = 0.125
    reference = jax.jit(lambda q, k, v, m: paged_attention(q, k, v, m, scale=scale))
    ragged = jax.jit(lambda q, k, v, m: ragged_attention(q, k, v, m, scale=scale, interpret=interpret))
    decode = jax.jit(lambda q, k, v, m: decode_attention(q, k, v, m, scale=scale, interpret=interpret))
    cases = {
        "decode 256 rows x 384 context": (batch([(383, 1)] * 256, decode=True, **shape), ("ragged", "decode")),
        "prefill 8 x 256 fresh": (batch([(0, 256)] * 8, **shape), ("ragged",)),
        "prefill 8 x 256 after 256 cached": (batch([(256, 256)] * 8, **shape), ("ragged",)),
        "mixed 1792 prefill + 256 decode": (batch([(0, 256)] * 7 + [(383, 1)] * 256, **shape), ("ragged",)),
    }
    kernels = {"ragged": ragged, "decode": decode}
    print(f"{jax.devices()[0].device_kind}, {a.dtype}, KVH=8 G=4 D=64 page=16")
    for name, ((q, k, v, meta), which) in cases.items():
        want = reference(q, k, v, meta)
        line = f"{name:>34}: reference {timed(reference, q, k, v, meta):7.3f} ms"
        for kname in which:
            got = kernels[kname](q, k, v, meta)
            line += f" | {kname} {timed(kernels[kname], q, k, v, meta):7.3f} ms (rel err {rel_err(got, want):.1e})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
