"""The sampler alone, jitted, on one batch of logits: each exact top-k / top-p / min-p method against greedy.

python benchmarks/sampler.py --rows 256 --vocab 128256 [--methods sort bisection search15] [--repeats 20]

Rows are the mixed workload's (benchmarks/throughput.py --workload mixed): a third greedy, a third temperature 0.8
+ top-p 0.9, a third temperature 1.0 + top-k 50 + min-p 0.05. Two logit distributions: "flat" (standard normal,
what random weights give: top-p 0.9 keeps most of the vocabulary) and "peaked" (Zipf-like, as trained models
give: top-p 0.9 keeps tens of tokens). Prints milliseconds per call (median of --repeats) and the ratio to an
all-greedy batch of the same shape; every method must draw the same tokens (they are all exact)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

from capstan.runtime.engine.batch import row_key_data  # noqa: E402
from capstan.runtime.engine.sampler import FILTERS, SamplingBatch, sample  # noqa: E402


def logits_of(kind: str, rows: int, vocab: int, rng) -> np.ndarray:
    if kind == "flat":
        return rng.standard_normal((rows, vocab)).astype(np.float32)
    ranks = np.argsort(rng.random((rows, vocab)), axis=-1) + 1  # a random order of the vocabulary per row
    return (-1.5 * np.log(ranks) + 0.3 * rng.standard_normal((rows, vocab))).astype(np.float32)


def mixed_batch(rows: int, vocab: int, greedy: bool) -> SamplingBatch:
    kind = np.arange(rows) % 3
    temperature = np.where(kind == 0, 0.0, np.where(kind == 1, 0.8, 1.0)).astype(np.float32)
    if greedy:
        temperature[:] = 0.0
    f32, i32 = (lambda v: np.full(rows, v, np.float32)), (lambda v: np.full(rows, v, np.int32))
    sampled = ~greedy & (kind != 0)
    return SamplingBatch(
        temperature=temperature, top_k=np.where(~greedy & (kind == 2), 50, 0).astype(np.int32),
        top_p=np.where(~greedy & (kind == 1), 0.9, 1.0).astype(np.float32),
        min_p=np.where(~greedy & (kind == 2), 0.05, 0.0).astype(np.float32),
        presence_penalty=f32(0), frequency_penalty=f32(0), repetition_penalty=f32(1),
        key_data=np.array([row_key_data(i, 0) for i in range(rows)], np.uint32), position=i32(7),
        bias_ids=np.full((rows, 1), vocab, np.int32), bias_values=np.zeros((rows, 1), np.float32),
        banned_ids=np.full((rows, 1), vocab, np.int32), history=np.full((rows, 1), vocab, np.int32),
        prompt_lens=i32(0), allowed=np.full((rows, -(-vocab // 32)), -1, np.int32), any_constrained=np.bool_(False),
        any_penalty=np.bool_(False), any_filter=np.bool_(bool(sampled.any())), want_logprobs=np.bool_(False),
        plain_greedy=np.bool_(greedy))


def timed(fn, *args, repeats: int) -> tuple[float, np.ndarray]:
    out = jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times), np.asarray(out.tokens)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--methods", nargs="+", default=list(FILTERS), choices=list(FILTERS))
    ap.add_argument("--distributions", nargs="+", default=["flat", "peaked"], choices=["flat", "peaked"])
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    print(f"device {jax.devices()[0].device_kind}, {a.rows} rows x {a.vocab} vocabulary, median of {a.repeats}")
    rng = np.random.default_rng(0)
    for dist in a.distributions:
        logits = jnp.asarray(logits_of(dist, a.rows, a.vocab, rng))
        greedy_ms, _ = timed(jax.jit(sample), logits, mixed_batch(a.rows, a.vocab, True), repeats=a.repeats)
        print(f"{dist:>7} {'all greedy':>12}: {greedy_ms:8.3f} ms")
        reference = None
        for method in a.methods:
            os.environ["CAPSTAN_SAMPLING_FILTERS"] = method  # read when the sampler is traced
            ms, tokens = timed(jax.jit(lambda x, b: sample(x, b)), logits, mixed_batch(a.rows, a.vocab, False),
                               repeats=a.repeats)
            reference = tokens if reference is None else reference
            same = "same tokens" if np.array_equal(tokens, reference) else \
                f"{int(np.sum(tokens != reference))} rows differ (float rounding at a threshold?)"
            print(f"{dist:>7} {method:>12}: {ms:8.3f} ms  {ms / greedy_ms:5.2f}x greedy  {same}")
        os.environ.pop("CAPSTAN_SAMPLING_FILTERS", None)


if __name__ == "__main__":
    main()
