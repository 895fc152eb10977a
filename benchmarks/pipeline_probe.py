"""Where a grammar batch's decode step goes: the host's parts of the decode pipeline, timed by wrapping them,
during the structured throughput run (llama-3.2-1b shape, 256 requests, half constrained); then the device-only
cost a step of the pipeline, the one-dispatch scan and the forward alone on an empty batch of 256 rows.

SHAPE=llama-3.2-1b python benchmarks/pipeline_probe.py   (on the lent GPU, after gpu_suite.sh's set-up)"""

import collections
import os
import sys
import time

import jax
import numpy as np
import throughput
from shapes import shape_config

import capstan.runtime.engine.engine as E
import capstan.runtime.engine.multi_step as M
import capstan.runtime.sampling.grammar as G
from capstan.runtime.config import DEFAULT_MODEL, EngineConfig
from capstan.runtime.engine.engine import LLMEngine
from capstan.runtime.models.loader import random_model

T: collections.Counter = collections.Counter()
N: collections.Counter = collections.Counter()
L: collections.defaultdict = collections.defaultdict(list)


def timed(name, f):
    def w(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        d = time.perf_counter() - t
        T[name] += d
        N[name] += 1
        L[name].append(d)
        return r

    return w


sys.argv = [
    "x",
    "--shape",
    os.environ.get("SHAPE", "llama-3.2-1b"),
    "--requests",
    "256",
    "--prompt-len",
    "256",
    "--output-len",
    "256",
    "--max-num-seqs",
    "256",
    "--max-num-batched-tokens",
    "2048",
    "--smallest-bucket",
    "256",
    "--constrained-fraction",
    "0.5",
]


def wrap(owner, name: str, label: str) -> None:
    """Times owner.name (a function or method) under label from now on."""
    setattr(owner, name, timed(label, getattr(owner, name)))


wrap(M, "fill_masks", "fill_masks")
wrap(M, "decode_forward_fn", "dispatch_forward")
wrap(M, "decode_sample_fn", "dispatch_sample")
wrap(G.TokenConstraint, "accept", "accept")
wrap(M.jax, "device_put", "device_put")
wrap(M.np, "full", "np_full")
wrap(M.MultiStepDecoder, "_pipeline", "pipeline_total")
wrap(E.LLMEngine, "_build", "build")
wrap(E.LLMEngine, "_collect_all", "collect")
wrap(E.LLMEngine, "_append_token", "append_token")
throughput.main()
for k in sorted(T, key=lambda name: T[name], reverse=True):
    last = np.asarray(L[k][-200:]) * 1e6
    print(
        f"{k:>18}: {T[k] * 1000:9.1f} ms total, {N[k]:7d} calls, last 200 calls: median {np.median(last):9.1f} us, "
        f"p90 {np.percentile(last, 90):9.1f} us"
    )
# device-only cost of a step: forward + sample chained with no host work, against the scan

cfg = shape_config(os.environ.get("SHAPE", "llama-3.2-1b"))
e = LLMEngine(
    EngineConfig(
        model=str(DEFAULT_MODEL),
        dtype="bfloat16" if jax.default_backend() == "gpu" else "float32",
        max_model_len=1024,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        smallest_token_bucket=256,
        enable_prefix_caching=False,
    ),
    model=random_model(cfg, "bfloat16" if jax.default_backend() == "gpu" else "float32"),
)
e.warmup()
inputs = e.builder.build([], bucket=256)
rows = jax.device_put(np.full(256, 16, np.int32))
for variant in ("pipeline", "pipeline_nomask", "scan", "forward_only"):
    for rep in range(3):
        t = time.perf_counter()
        if variant == "forward_only":
            prev = rows
            for j in range(16):
                e.kv, out = M.decode_forward_fn(e.model, e.kv, inputs, prev, rows, np.int32(j))
        elif variant == "scan":
            e.kv, out, _ = M.decode_steps_fn(
                e.model,
                e.kv,
                inputs,
                rows,
                np.int32(0),
                np.zeros((16, 256), np.int32),
                e.multi_step._block_tables([], 256),
                e.multi_step._no_counts(256, M.SCAN_BRANCHES),
                num_steps=16,
            )
        else:
            prev = rows
            for j in range(16):
                e.kv, logits = M.decode_forward_fn(e.model, e.kv, inputs, prev, rows, np.int32(j))
                allowed = (
                    e.builder.all_allowed
                    if variant == "pipeline_nomask"
                    else jax.device_put(np.full((256, (cfg.vocab_size + 31) // 32), -1, np.int32))
                )
                out = M.decode_sample_fn(
                    logits,
                    inputs,
                    allowed,
                    np.int32(j),
                    branches=M.pipeline_branches(all_greedy=True, any_filter=False, want_logprobs=False),
                )
                prev = out.tokens
        jax.block_until_ready(out)
        print(f"{variant:>16} rep {rep}: {(time.perf_counter() - t) * 1000 / 16:.3f} ms/step (empty batch of 256 rows)")
