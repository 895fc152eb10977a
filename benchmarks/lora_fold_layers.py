"""One stream through a stack of Llama-shaped linear layers, plain and with a rank-R adapter on all seven projections
applied four ways (GPU microbenchmark for issue 32's one-stream overhead):

  separate  the shrink (x @ A) and the expand (h @ B) as their own small contractions beside the base matmul
            (models/lora.py's gathered way today)
  concat    the shrink folded: the step concatenates [W; every slot's A] and one matmul reads both (CAPSTAN_LORA_FOLD)
  stored    the shrink folded into a weight stored with the slots' A rows after W's own, so the step concatenates
            nothing: one plain matmul, the rank space sliced off its output

python benchmarks/lora_fold_layers.py --shape llama-3.2-1b --slots 1 8 --rank 16
Prints milliseconds per pass through all layers and each way's ratio to the plain layers. Attention and norms are
left out (the same in every way); each layer's q columns stand in for its attention output."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402


def layer_weights(key, E: int, Q: int, N: int, I: int, slots: int, R: int, dtype):
    ks = jax.random.split(key, 8)
    w = lambda k, *s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(dtype)  # noqa: E731
    return {
        "qkv": w(ks[0], N, E),
        "o": w(ks[1], E, Q),
        "gate_up": w(ks[2], 2 * I, E),
        "down": w(ks[3], E, I),
        # every slot's A (rows) and B (columns) per projection; q/k/v and gate/up share an input, so one A block each
        "qkv_a": w(ks[4], slots * 3 * R, E),
        "o_a": w(ks[5], slots * R, Q),
        "gate_up_a": w(ks[6], slots * 2 * R, E),
        "down_a": w(ks[7], slots * R, I),
        "qkv_b": w(ks[4], 3 * R, N),
        "o_b": w(ks[5], R, E),
        "gate_up_b": w(ks[6], 2 * R, 2 * I),
        "down_b": w(ks[7], R, E),
    }


def stored(layer: dict) -> dict:
    """The layer as the stored way holds it: each projection's W with its slots' A rows after its own."""
    out = dict(layer)
    for p in ("qkv", "o", "gate_up", "down"):
        out[p] = jnp.concatenate([layer[p], layer[p + "_a"]])
    return out


def project(way: str, x, layer: dict, p: str, rows: int, R: int):
    """x @ W.T plus slot 0's delta, the way `way` computes it."""
    w, a, b = layer[p], layer[p + "_a"], layer[p + "_b"]
    if way == "plain":
        return x @ w.T
    if way == "separate":
        h = jnp.einsum("te,re->tr", x.astype(jnp.float32), a[:rows].astype(jnp.float32))
    else:
        both = w if way == "stored" else jnp.concatenate([w, a])
        y = x @ both.T
        n = both.shape[0] - a.shape[0]
        x_out, h = y[:, :n], y[:, n : n + rows].astype(jnp.float32)
        return x_out + (h @ b.astype(jnp.float32)).astype(x.dtype)
    return x @ w.T + (h @ b.astype(jnp.float32)).astype(x.dtype)


def forward(way: str, x, layers, E: int, I: int, R: int):
    for layer in layers:
        qkv = project(way, x, layer, "qkv", 3 * R, R)
        attn = qkv[:, : layer["o"].shape[1]]
        x = x + project(way, attn, layer, "o", R, R)
        gu = project(way, x, layer, "gate_up", 2 * R, R)
        x = x + project(way, jax.nn.silu(gu[:, :I]) * gu[:, I:], layer, "down", R, R)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--passes", type=int, default=300)
    args = parser.parse_args()
    c = shape_config(args.shape)
    E, I, R = c.hidden_size, c.intermediate_size, args.rank
    Q, N = c.num_heads * c.head_dim, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    print(jax.devices()[0].device_kind, args.shape, f"{c.num_layers} layers, rank {R}")
    for slots in args.slots:
        keys = jax.random.split(jax.random.PRNGKey(0), c.num_layers)
        layers = [layer_weights(k, E, Q, N, I, slots, R, jnp.bfloat16) for k in keys]
        x = (jax.random.normal(jax.random.PRNGKey(1), (1, E)) * 0.1).astype(jnp.bfloat16)
        times = {}
        for way in ("plain", "separate", "concat", "stored"):
            held = [stored(layer) for layer in layers] if way == "stored" else layers
            fn = jax.jit(lambda x, ls, way=way: forward(way, x, ls, E, I, R))
            y = fn(x, held).block_until_ready()  # compiled
            start = time.perf_counter()
            for _ in range(args.passes):
                y = fn(x, held)
            y.block_until_ready()
            times[way] = (time.perf_counter() - start) / args.passes * 1e3
            del held
        base = times["plain"]
        for way, ms in times.items():
            print(f"slots {slots} {way:>9}: {ms:.3f} ms a pass, {ms / base:.3f}x plain")


if __name__ == "__main__":
    main()
