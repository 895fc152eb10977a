"""Paged attention kernels against the plain-XLA reference on one layer of a Llama-3.2-1B-shaped cache.

python benchmarks/attention_kernels.py [--dtype bfloat16]
prints milliseconds per call for a decode batch (256 rows) and for mixed prefill steps (2048 tokens), with the
kernels' relative error against the reference. On CPU the kernels run interpreted (correct, not fast).

python benchmarks/attention_kernels.py --sweep
times JAX's decode kernel over its Triton tuning (warps, pipeline stages, pages a block) on decode batches of the
Llama-3.2-1B and Qwen3-0.6B heads (256 rows of 256-511 tokens, as the headline's decode phase has; one row).

python benchmarks/attention_kernels.py --fp8
times the ragged kernel and JAX's decode kernel on bf16 pages and on the same values in FP8 pages (--kv-cache-dtype
fp8, scales 0.03 / 0.07), Llama-3-8B and Qwen3-0.6B heads, with each FP8 result's relative error against the
reference over the same FP8 pages (a check that it reads them right). The fused decode kernel updates its pages in
place, so it is timed in whole decode steps instead (decode_profile.py --kv-cache-dtype fp8)."""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from capstan.runtime.attention import INVALID_SLOT, AttentionMetadata, paged_attention, query_blocks
from capstan.runtime.kernels.gpu_decode_attention import decode_attention
from capstan.runtime.kernels.gpu_ragged_attention import ragged_attention

sys.path.insert(0, str(Path(__file__).parent))
from timing import median_ms  # noqa: E402


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
        positions=jnp.asarray(positions),
        slot_mapping=jnp.full(T, INVALID_SLOT, jnp.int32),
        token_seq=jnp.asarray(token_seq),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray([s + n for s, n in chunks], jnp.int32),
        decode=decode,
        query_blocks=None
        if decode
        else jnp.asarray(query_blocks([(r, s, n) for r, (s, n) in enumerate(chunks)], T, S, G)),
    )
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
    ap.add_argument("--sweep", action="store_true", help="time the decode kernel's tuning instead")
    ap.add_argument("--fp8", action="store_true", help="time the kernels on bf16 pages against FP8 pages instead")
    ap.add_argument("--ragged-sweep", action="store_true", help="time the ragged kernel's tuning, bf16 and FP8 pages")
    a = ap.parse_args()
    dtype = jnp.dtype(a.dtype)
    if a.ragged_sweep:
        return ragged_sweep(dtype)
    if a.sweep:
        return sweep(dtype)
    if a.fp8:
        return fp8_pages(dtype)
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


def fp8_pages(dtype) -> None:
    """Each kernel on bf16 pages and on FP8 pages holding the same values: FP8 halves the bytes the kernels read."""
    from capstan.runtime.attention.kv_quantization import FP8, store

    interpret = jax.default_backend() != "gpu"
    k_scale, v_scale = 0.03, 0.07
    small = interpret  # interpreted on CPU: tiny shapes, to check the script runs
    rows, context, long = (4, 40, 100) if small else (256, 1024, 4096)
    heads = {
        "Llama-3.2-1B heads (8 x 4, 64)": (8, 4, 64),
        "Llama-3-8B heads (8 x 4, 128)": (8, 4, 128),
        "Qwen3-0.6B heads (8 x 2, 128)": (8, 2, 128),
    }
    print(
        f"{jax.devices()[0].device_kind}: ms a call, {jnp.dtype(dtype).name} pages / FP8 pages (rel err vs reference)"
    )
    for hname, (KVH, G, D) in heads.items():
        scale = D**-0.5
        cases = {
            f"decode {rows} rows x {context}": batch(
                [(context - 1, 1)] * rows, decode=True, KVH=KVH, G=G, D=D, page=16, max_len=context, dtype=dtype
            ),
            f"decode 1 row x {long}": batch(
                [(long - 1, 1)], decode=True, KVH=KVH, G=G, D=D, page=16, max_len=long, dtype=dtype
            ),
            f"prefill 4 x {context // 2} after {context // 2}": batch(
                [(context // 2, context // 2)] * 4, KVH=KVH, G=G, D=D, page=16, max_len=context, dtype=dtype
            ),
            **mixed_steps(KVH, G, D, dtype, small),
        }
        for cname, (q, k, v, meta) in cases.items():
            k8, v8 = store(k, FP8, k_scale), store(v, FP8, v_scale)
            want = paged_attention(q, k8, v8, meta, scale=scale, k_scale=k_scale, v_scale=v_scale)
            kernels: dict[str, Callable] = {"ragged": ragged_attention}
            if meta.decode:
                kernels["decode"] = decode_attention
            line = f"{hname}, {cname}:"
            for kname, kernel in kernels.items():
                plain = jax.jit(functools.partial(kernel, scale=scale, interpret=interpret))
                fp8 = jax.jit(
                    functools.partial(kernel, scale=scale, k_scale=k_scale, v_scale=v_scale, interpret=interpret)
                )
                err = rel_err(np.asarray(fp8(q, k8, v8, meta), np.float32), np.asarray(want, np.float32))
                line += f" | {kname} {timed(plain, q, k, v, meta):.4f} / {timed(fp8, q, k8, v8, meta):.4f} ({err:.1e})"
            print(line, flush=True)


def mixed_steps(KVH, G, D, dtype, small: bool) -> dict:
    """Steps of the mixed workload's prefill phase: fresh prompts, and prompts beside decode tokens."""
    if small:
        return {
            "mixed 2 x 16 fresh + 4 decode": batch(
                [(0, 16)] * 2 + [(39, 1)] * 4, KVH=KVH, G=G, D=D, page=16, max_len=40, dtype=dtype
            )
        }
    return {
        "prefill 8 x 256 fresh": batch([(0, 256)] * 8, KVH=KVH, G=G, D=D, page=16, max_len=528, dtype=dtype),
        "mixed 1792 fresh + 256 decode x 384": batch(
            [(0, 256)] * 7 + [(383, 1)] * 256, KVH=KVH, G=G, D=D, page=16, max_len=528, dtype=dtype
        ),
    }


def time_tunings(kernel, args, want, pages_options, label: str = "", first_only: bool = False) -> list[tuple]:
    """(ms, warps, stages, pages a block, rel err vs want) for each Triton tuning of `kernel` that builds, fastest
    first; first_only: the first that builds (a check on CPU, where the kernels run interpreted)."""
    results = []
    for warps, stages, pages in itertools.product((2, 4, 8), (1, 2, 3), pages_options):
        fn = jax.jit(functools.partial(kernel, num_warps=warps, num_stages=stages, pages_per_block=pages))
        try:
            ms, err = timed(fn, *args), rel_err(fn(*args), want)
        except Exception as e:  # noqa: BLE001 - a tuning Triton cannot build: say so, go on
            print(f"  {label}warps {warps} stages {stages} pages {pages}: {type(e).__name__}", flush=True)
            continue
        results.append((ms, warps, stages, pages, err))
        if first_only:
            break
    return sorted(results)


def ragged_sweep(dtype) -> None:
    """The ragged kernel's Triton tuning on bf16 and FP8 pages, Llama-3.2-1B and Qwen3-0.6B heads, the mixed
    workload's prefill-phase steps."""
    from capstan.runtime.attention.kv_quantization import FP8, store

    small = jax.default_backend() != "gpu"
    print(f"{jax.devices()[0].device_kind}: ragged kernel, ms a call (rel err vs reference)")
    for hname, (KVH, G, D) in {"1B heads": (8, 4, 64), "Qwen3 heads": (8, 2, 128)}.items():
        for cname, (q, k, v, meta) in mixed_steps(KVH, G, D, dtype, small).items():
            for pages_dtype in ("bf16", "fp8"):
                k_scale, v_scale = (0.03, 0.07) if pages_dtype == "fp8" else (1.0, 1.0)
                kp, vp = (store(k, FP8, k_scale), store(v, FP8, v_scale)) if pages_dtype == "fp8" else (k, v)
                want = paged_attention(q, kp, vp, meta, scale=D**-0.5, k_scale=k_scale, v_scale=v_scale)
                kernel = functools.partial(
                    ragged_attention, scale=D**-0.5, k_scale=k_scale, v_scale=v_scale, interpret=small
                )
                results = time_tunings(kernel, (q, kp, vp, meta), want, (None, 4, 16), first_only=small)
                default = next((r for r in results if r[1:4] == (4, 2, None)), results[0])
                print(f"{hname}, {cname}, {pages_dtype} pages: default (4, 2, tile) {default[0]:.4f} ms", flush=True)
                for ms, warps, stages, pages, err in results[:4]:
                    print(
                        f"  warps {warps} stages {stages} pages/block {pages or 'tile'}: {ms:.4f} ms ({err:.1e})",
                        flush=True,
                    )


def sweep(dtype) -> None:
    """The decode kernel's Triton tuning, each against the default, on the decode batches serving sees."""
    rng = np.random.default_rng(1)
    mixed = [(int(n) - 1, 1) for n in rng.integers(256, 512, 256)]  # 256 rows, contexts 256..511
    cases = {
        "1B heads, 256 rows x 256-511": (
            batch(mixed, decode=True, KVH=8, G=4, D=64, page=16, max_len=528, dtype=dtype),
            0.125,
        ),
        "Qwen heads, 256 rows x 256-511": (
            batch(mixed, decode=True, KVH=8, G=2, D=128, page=16, max_len=528, dtype=dtype),
            128**-0.5,
        ),
        "1B heads, 1 row x 384": (
            batch([(383, 1)], decode=True, KVH=8, G=4, D=64, page=16, max_len=528, dtype=dtype),
            0.125,
        ),
    }
    print(f"{jax.devices()[0].device_kind}, {jnp.dtype(dtype).name}: decode kernel, ms (rel err vs reference)")
    for name, ((q, k, v, meta), scale) in cases.items():
        want = paged_attention(q, k, v, meta, scale=scale)
        kernel = functools.partial(decode_attention, scale=scale)
        results = time_tunings(kernel, (q, k, v, meta), want, (None, 4, 8, 16), label=f"{name}: ")
        jax_default = next(r for r in results if r[1:4] == (8, 2, 8))
        print(f"{name}: JAX's defaults (warps 8, stages 2, 8 pages a block) {jax_default[0]:.4f} ms", flush=True)
        for ms, warps, stages, pages, err in results[:6]:
            print(f"  warps {warps} stages {stages} pages/block {pages or 'auto'}: {ms:.4f} ms ({err:.1e})", flush=True)
        ours = jax.jit(functools.partial(decode_attention, scale=scale))
        print(f"  ours (gpu_decode's tuning): {timed(ours, q, k, v, meta):.4f} ms", flush=True)


if __name__ == "__main__":
    main()
