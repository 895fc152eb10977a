"""One stream's linear layers, XLA's dot against Capstan's Pallas GEMV kernel (GPU microbenchmark).

python benchmarks/gemv.py --shapes llama-3.2-1b llama-3-8b --weights bf16 fp8 int8 --rows 1 8
python benchmarks/gemv.py --shapes llama-3-8b --weights fp8 --sweep      # Triton tunings, best first
python benchmarks/gemv.py --weights bf16 --mgpu   # also JAX's own Hopper matmul (Pallas Mosaic GPU: TMA, wgmma)
Each layer's projection (fused QKV, o, fused gate-up, down) as the model holds it ([out, in], per-channel scales
for fp8 and int8, a scale per 32 inputs for GGUF's q8_0), a stack of distinct copies big enough to miss the L2
cache, called back to back (the host's dispatch overlaps the device); prints microseconds per matmul and the
weight's read rate in GB/s."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402

from capstan.runtime.kernels import gpu_gemv  # noqa: E402

STORED = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "q8_0": jnp.int8}
BLOCK = {"q8_0": 32}  # GGUF Q8_0: int8 with a scale per 32 inputs of a row
STACK_BYTES = 200e6  # four times the H100's 50 MB L2


def projections(shape: str) -> dict[str, tuple[int, int]]:
    c = shape_config(shape)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }


def xla_linear(x, w, scale):
    """What QuantizedWeight / hax.dot run without the kernel: the weight upcast inside the dot, then scaled (Q8_0:
    upcast and scaled block by block first, as QuantizedWeight._unblocked)."""
    if scale is not None and scale.ndim == 2:
        blocks = w.astype(x.dtype).reshape(*scale.shape, -1) * scale[..., None].astype(x.dtype)
        return jnp.einsum("rk,nk->rn", x, blocks.reshape(w.shape), preferred_element_type=jnp.float32).astype(x.dtype)
    y = jnp.einsum("rk,nk->rn", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y if scale is None else y * scale).astype(x.dtype)


def per_call_us(matmul, x, ws, scale, calls: int = 20) -> float:
    """Microseconds per matmul over a stack of weights, dispatched back to back."""
    run = jax.jit(lambda x, ws, s: [matmul(x, w, s) for w in ws])
    jax.block_until_ready(run(x, ws, scale))
    t0 = time.perf_counter()
    outs = [run(x, ws, scale) for _ in range(calls)]
    jax.block_until_ready(outs)
    return 1e6 * (time.perf_counter() - t0) / calls / len(ws)


def mgpu_configs():
    """Tunings of JAX's Hopper matmul (jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu) for one row: its tiles
    stream through shared memory by TMA, max_concurrent_steps deep, into wgmma. It has no split-K, so a matmul with
    few output tiles leaves SMs idle; what it answers is whether TMA streaming reads the weights faster than XLA's
    Triton GEMV (57-85% of the bandwidth) where there are tiles enough. Two forms: "rows", x padded to 64 rows times
    the weight transposed ([K, N], a copy), N split into tiles; "cols", the weight as stored ([N, K]) times x as a
    column padded to 64 or 128, N split into 64-row tiles (twice the tiles of the first form's 128-wide ones);
    "split", split-K as more rows: the weight laid out once as [S * N, K / S] (split s's rows after split s - 1's),
    times x's S slices as S columns of the padding, each split's partial taken from its own column and the S summed
    (S times the output tiles: enough for o and down)."""
    for tile_n, tile_k, steps in itertools.product((64, 128), (64, 128), (4, 8)):
        yield (
            f"mgpu rows n={tile_n} k={tile_k} steps={steps}",
            "rows",
            dict(tile_n=tile_n, tile_k=tile_k, max_concurrent_steps=steps),
        )
    for wg, tile_k, steps in itertools.product(("N", "M"), (64, 128), (4, 8)):
        yield (
            f"mgpu cols wg={wg} k={tile_k} steps={steps}",
            "cols",
            dict(wg=wg, tile_k=tile_k, max_concurrent_steps=steps),
        )
    for splits, steps in itertools.product((2, 4, 8), (4, 8)):
        yield (
            f"mgpu split S={splits} k=64 steps={steps}",
            "split",
            dict(splits=splits, tile_k=64, max_concurrent_steps=steps),
        )


def split_layout(w: jax.Array, splits: int) -> jax.Array:
    """[N, K] -> [S * N, K / S]: row s * N + n holds w[n, s * K / S : (s + 1) * K / S] (a load-time layout)."""
    n, k = w.shape
    return w.reshape(n, splits, k // splits).transpose(1, 0, 2).reshape(splits * n, k // splits)


def mgpu_linear(form: str, tuning: dict):
    """x [rows, K] times the weight by JAX's Hopper matmul, in one of mgpu_configs' forms; the padding's products are
    computed and dropped (the weights' bytes bound it anyway). "rows" takes the weight as [K, N], "cols" as [N, K],
    "split" as split_layout(w, splits)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    dims = hm.MatmulDimension
    tuning = dict(tuning)
    splits = tuning.pop("splits", 1)
    wg = dims[tuning.pop("wg", "N")]
    tile_n = tuning.pop("tile_n", 64)
    config = hm.TuningConfig(
        tile_m=64,
        tile_n=tile_n,
        epi_tile_n=64,
        epi_tile_m=64,
        grid_minor_dim=dims.N,
        grid_tile_width=1,
        wg_dimension=wg,
        **tuning,
    )
    cols = 2 * tile_n if wg == dims.N else tile_n  # the "cols" form: the kernel's tile of x's columns

    def rows_form(x, wt, scale):
        padded = jnp.zeros((64, x.shape[1]), x.dtype).at[: x.shape[0]].set(x)
        return hm.matmul(padded, wt, None, config)[: x.shape[0]]

    def cols_form(x, w, scale):
        padded = jnp.zeros((x.shape[1], cols), x.dtype).at[:, : x.shape[0]].set(x.T)
        return hm.matmul(w, padded, None, config)[:, : x.shape[0]].T

    def split_form(x, w_split, scale):
        rows, k = x.shape
        slices = x.reshape(rows, splits, k // splits).transpose(1, 0, 2).reshape(splits * rows, k // splits)
        padded = jnp.zeros((k // splits, cols), x.dtype).at[:, : splits * rows].set(slices.T)
        out = hm.matmul(w_split, padded, None, config)  # [S * N, cols]: split s's rows against every split's x
        n = w_split.shape[0] // splits
        parts = out.reshape(splits, n, cols)[:, :, : splits * rows].reshape(splits, n, splits, rows)
        diagonal = parts[jnp.arange(splits), :, jnp.arange(splits)]  # [S, N, rows]: each split against its own x
        return jnp.sum(diagonal.astype(jnp.float32), axis=0).T.astype(x.dtype)

    return {"rows": rows_form, "cols": cols_form, "split": split_form}[form]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3-8b"])
    ap.add_argument("--weights", nargs="+", choices=list(STORED), default=["bf16", "fp8"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--sweep", action="store_true", help="also try Triton tunings (block_n, block_k, warps, stages)")
    ap.add_argument("--mgpu", action="store_true", help="also JAX's Hopper matmul kernel (bf16 only), tunings swept")
    a = ap.parse_args()
    print(
        f"device: {jax.devices()[0].device_kind}; kernel default tuning (block_n, warps, stages, reduce) {gpu_gemv.TUNING}"
    )
    key = jax.random.key(0)
    for shape, stored, rows in itertools.product(a.shapes, a.weights, a.rows):
        for name, (n, k) in projections(shape).items():
            copies = int(min(32, max(2, STACK_BYTES // (n * k * jnp.dtype(STORED[stored]).itemsize))))
            ws = [
                (jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32) * 8).astype(STORED[stored])
                for i in range(copies)
            ]
            block = BLOCK.get(stored, 0)
            scale = None if stored == "bf16" else jnp.full((n, k // block) if block else (n,), 0.01, jnp.float32)
            x = jax.random.normal(key, (rows, k), jnp.float32).astype(jnp.bfloat16)
            gb = n * k * jnp.dtype(STORED[stored]).itemsize / 1e9
            ref = np.asarray(xla_linear(x, ws[0], scale), np.float32)
            kernel = lambda x, w, s, block=block, **tuning: gpu_gemv.gemv(x, w, s, block=block, **tuning)  # noqa: E731
            got = np.asarray(kernel(x, ws[0], scale), np.float32)
            err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-9))
            xla = per_call_us(xla_linear, x, ws, scale)
            results = [(per_call_us(kernel, x, ws, scale), "default")]
            if a.sweep:
                for reduce, (bn, bk), warps, stages in itertools.product(
                    (False, True), ((16, 512), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128)), (4, 8), (2, 4)
                ):
                    if k % bk or n % bn:
                        continue
                    tuned = lambda x, w, s, t=(bn, bk, warps, stages, reduce), kernel=kernel: kernel(  # noqa: E731
                        x, w, s, block_n=t[0], block_k=t[1], num_warps=t[2], num_stages=t[3], reduce=t[4]
                    )
                    label = f"{'reduce' if reduce else 'dot'} bn={bn} bk={bk} w={warps} s={stages}"
                    try:
                        results.append((per_call_us(tuned, x, ws, scale, calls=10), label))
                    except Exception as e:  # a tuning Triton cannot compile (shared memory) is skipped, named
                        print(f"   skipped {label}: {type(e).__name__}")
            if a.mgpu and stored == "bf16":
                wts = [jnp.asarray(w.T) for w in ws]  # [K, N]: a copy, laid out as the "rows" form reads it
                for label, form, tuning in mgpu_configs():
                    if form == "split":
                        stack = [split_layout(w, tuning["splits"]) for w in ws]
                    else:
                        stack = wts if form == "rows" else ws
                    try:
                        linear = mgpu_linear(form, tuning)
                        mg_err = float(np.abs(np.asarray(linear(x, stack[0], None), np.float32) - ref).max())
                        us = per_call_us(linear, x, stack, None, calls=10)
                    except Exception as e:  # a tiling the kernel refuses (divisibility, shared memory): named, skipped
                        print(f"   skipped {label}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}")
                        continue
                    results.append((us, f"{label} err {mg_err / max(np.abs(ref).max(), 1e-9):.1e}"))
            results.sort()
            best_us, best = results[0]
            print(
                f"{shape:>13} {stored:>4} rows={rows:<2} {name:>7} [{n}x{k}] xla {xla:7.1f} us {gb / xla * 1e6:6.0f} GB/s"
                f" | kernel {dict((b, u) for u, b in results)['default']:7.1f} us | best {best_us:7.1f} us "
                f"{gb / best_us * 1e6:6.0f} GB/s ({best}) | max rel err {err:.1e}",
                flush=True,
            )
            if a.sweep or a.mgpu:
                print("      top:", "; ".join(f"{u:.1f} {b}" for u, b in results[:5]), flush=True)


if __name__ == "__main__":
    main()
