"""Time one bf16 prefill of a named shape with random weights: python benchmarks/prefill.py --shape llama-3.2-1b --tokens 2048

Runs the model over one sequence of --tokens tokens through the paged KV cache and the next-token logits
at its end; checks for NaN; prints the median of --repeats timed runs after a warm-up."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402

from capstan.runtime.attention import AttentionMetadata, query_blocks  # noqa: E402
from capstan.runtime.kv.cache import KVCache  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402


@jax.jit
def prefill(model, tokens, meta, kv):
    hidden, kv = model(tokens, meta, kv)
    return model.logits(hidden["token", -1:]).array, kv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    cfg = shape_config(a.shape)
    model = random_model(cfg, a.dtype)
    T, page = a.tokens, a.page_size
    pages = -(-T // page)
    kv = KVCache.allocate(cfg.num_layers, pages, page, cfg.num_kv_heads, cfg.head_dim, model.embedding.dtype)
    meta = AttentionMetadata(
        positions=jnp.arange(T, dtype=jnp.int32),
        slot_mapping=jnp.arange(T, dtype=jnp.int32),
        token_seq=jnp.zeros(T, jnp.int32),
        block_tables=jnp.arange(pages, dtype=jnp.int32)[None],
        seq_lens=jnp.asarray([T], jnp.int32),
        query_blocks=jnp.asarray(query_blocks([(0, 0, T)], T, 1, cfg.queries_per_kv)),
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, T), jnp.int32)
    t0 = time.perf_counter()
    logits, kv = prefill(model, tokens, meta, kv)
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        logits, kv = prefill(model, tokens, meta, kv)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
    ok = bool(jnp.all(jnp.isfinite(logits)))
    print(
        f"shape={a.shape} dtype={a.dtype} tokens={T} device={jax.devices()[0].device_kind} "
        f"compile_s={compile_s:.1f} prefill_ms_median={1000 * statistics.median(times):.2f} "
        f"tokens_per_s={T / statistics.median(times):.0f} finite={ok}"
    )


if __name__ == "__main__":
    main()
