"""A prefill step's K/V write into one layer's pages: the engine's scatter of the stored floats against a scatter of
their bits (a bitcast to unsigned integers of the same width around it).

python benchmarks/page_writes.py [--pages 16641] [--tokens 2048]
prints, for bf16 and FP8 pages of Llama-3.2-1B's heads (8 KV heads x 64), ms per write of `tokens` rows into a pool
of `pages` 16-token pages (donated, as the engine's step donates its cache), and the optimized HLO's instructions
that touch the whole pool besides the scatter itself (a convert or copy there means the write moves every page).
Measured (benchmarks/RESULTS.md, issue 31's FP8 block): on an H200 neither moves the pool; on CPU XLA converts a
bfloat16 or FP8 pool to a wider float around the scatter, while float32 (the CPU default) scatters in place."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from timing import median_ms  # noqa: E402

from capstan.runtime.attention.kv_quantization import FP8, store  # noqa: E402
from capstan.runtime.attention.reference import write_kv  # noqa: E402


def as_bits(cache, slots, values, page_size, scale):
    """write_kv's scatter moved as unsigned integers of the pages' width (same bytes)."""
    bits = jnp.dtype(f"uint{8 * cache.dtype.itemsize}")
    stored = jax.lax.bitcast_convert_type(store(jnp.swapaxes(values, 0, 1), cache.dtype, scale), bits)
    index = (slice(None), slots // page_size, slots % page_size)
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(cache, bits).at[index].set(stored, mode="drop"), cache.dtype
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=16641)
    ap.add_argument("--tokens", type=int, default=2048)
    a = ap.parse_args()
    page, KVH, D = 16, 8, 64
    slots = (jnp.arange(a.tokens, dtype=jnp.int32) * 7) % (a.pages * page)
    values = jax.random.normal(jax.random.key(0), (a.tokens, KVH, D), jnp.bfloat16)
    print(f"{jax.devices()[0].device_kind}: {a.tokens} tokens into {a.pages} pages of {page} x {KVH} x {D}")
    for dtype in (jnp.float32, jnp.bfloat16, FP8):
        for name, write in (("floats", write_kv), ("bits", as_bits)):
            fn = jax.jit(lambda c, s, v, w=write: w(c, s, v, page, 0.5), donate_argnums=0)
            cache = jnp.zeros((KVH, a.pages, page, D), dtype)
            hlo = fn.lower(cache, slots, values).compile().as_text() or ""
            whole = f"{KVH},{a.pages},{page},{D}]"
            ops = (" convert(", " copy(", " bitcast-convert(")
            moves = sorted({op.strip() for line in hlo.splitlines() if whole in line for op in ops if op in line})
            state = {"cache": cache}

            def run(s, v, fn=fn, state=state):
                state["cache"] = fn(state["cache"], s, v)
                return state["cache"]

            ms = median_ms(run, slots, values)
            print(f"  {jnp.dtype(dtype).name:>14} pages, scattered as {name:>6}: {ms:8.4f} ms; whole-pool {moves}")


if __name__ == "__main__":
    main()
