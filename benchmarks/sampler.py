"""The sampler alone, jitted, on one batch of logits: each exact top-k / top-p / min-p method against greedy.

python benchmarks/sampler.py --rows 256 --vocab 128256 [--methods sort bisection search15] [--repeats 20]

Rows are the mixed workload's (benchmarks/throughput.py --workload mixed): a third greedy, a third temperature 0.8
+ top-p 0.9, a third temperature 1.0 + top-k 50 + min-p 0.05. Two logit distributions: "flat" (standard normal,
what random weights give: top-p 0.9 keeps most of the vocabulary) and "peaked" (Zipf-like, as trained models
give: top-p 0.9 keeps tens of tokens). Prints milliseconds per call (median of --repeats) and the ratio to an
all-greedy batch of the same shape; every method must draw the same tokens (they are all exact)."""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from capstan.runtime.sampling.sampler import (  # noqa: E402
    DRAWN,
    DRAWS,
    FILTERS,
    Branches,
    SamplingBatch,
    block_candidates,
    gumbel_row,
    mass_above,
    sample,
)
from capstan.runtime.scheduling.batch import row_key_data  # noqa: E402


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
        temperature=temperature,
        top_k=np.where(~greedy & (kind == 2), 50, 0).astype(np.int32),
        top_p=np.where(~greedy & (kind == 1), 0.9, 1.0).astype(np.float32),
        min_p=np.where(~greedy & (kind == 2), 0.05, 0.0).astype(np.float32),
        presence_penalty=f32(0),
        frequency_penalty=f32(0),
        repetition_penalty=f32(1),
        key_data=np.array([row_key_data(i, 0) for i in range(rows)], np.uint32),
        position=i32(7),
        bias_ids=np.full((rows, 1), vocab, np.int32),
        bias_values=np.zeros((rows, 1), np.float32),
        banned_ids=np.full((rows, 1), vocab, np.int32),
        history=np.full((rows, 1), vocab, np.int32),
        prompt_lens=i32(0),
        allowed=np.full((rows, -(-vocab // 32)), -1, np.int32),
        any_constrained=np.bool_(False),
        any_penalty=np.bool_(False),
        any_filter=np.bool_(bool(sampled.any())),
        want_logprobs=np.bool_(False),
        plain_greedy=np.bool_(greedy),
    )


def branches_of(b: SamplingBatch) -> Branches:
    """The branches the host decides for the batch (the grammar pipeline's way: no lax.cond in the program)."""
    return Branches(
        plain_greedy=bool(b.plain_greedy),
        any_constrained=bool(b.any_constrained),
        any_penalty=bool(b.any_penalty),
        any_filter=bool(b.any_filter),
        all_greedy=bool(np.all(b.temperature == 0)),
        want_logprobs=bool(b.want_logprobs),
    )


def breakdown(logits, batch: SamplingBatch, methods, repeats: int) -> None:
    """Where a sampled step's time goes: the Gumbel noise alone, each filter alone, the draw without filters."""
    V = logits.shape[1]
    keys = jnp.asarray(batch.key_data)
    noise = jax.jit(lambda k: gumbel_row(k, V))  # the sampler's own noise over the row
    ms, _ = timed(noise, keys, repeats=repeats)
    print(f"{'':>7} {'gumbel noise':>12}: {ms:8.3f} ms")
    unfiltered = eqx.tree_at(lambda b: b.any_filter, batch, np.bool_(False))
    ms, _ = timed(
        jax.jit(functools.partial(sample, branches=branches_of(unfiltered))),
        logits,
        jax.device_put(unfiltered),
        repeats=repeats,
    )
    print(f"{'':>7} {'no filters':>12}: {ms:8.3f} ms  (bias, temperature, Gumbel draw)")
    if "candidates" in methods:  # the candidates draw's stages, each alone
        ms, _ = timed(jax.jit(block_candidates), logits, repeats=repeats)
        print(f"{'':>7} {'candidates: blocks':>12}: {ms:8.3f} ms  (block maxima, the top blocks, their sort)")
        best = jax.jit(lambda x, k: jax.lax.top_k(x + noise(k), DRAWN)[1])
        ms, ids = timed(best, logits, keys, repeats=repeats)
        print(f"{'':>7} {'candidates: drawn':>12}: {ms:8.3f} ms  (noise, the {DRAWN} best perturbed values)")
        drawn = jnp.take_along_axis(logits, jnp.asarray(ids), axis=-1)
        ms, _ = timed(jax.jit(lambda x, d: mass_above(x, jnp.exp(x), d)), logits, drawn, repeats=repeats)
        print(f"{'':>7} {'candidates: mass':>12}: {ms:8.3f} ms  (the mass above each drawn value)")
    for method in [m for m in methods if m in FILTERS]:  # a draw (DRAWS) filters as it draws: no filter alone
        ms, _ = timed(jax.jit(FILTERS[method]), logits, jax.device_put(batch), repeats=repeats)
        print(f"{'':>7} {'filter ' + method:>12}: {ms:8.3f} ms")


def timed(fn, *args, repeats: int) -> tuple[float, np.ndarray]:
    """Median ms of fn(*args) to its result on the host side's hands (a SampleResult's tokens, or the array)."""
    result = lambda: getattr(out := fn(*args), "tokens", out)  # noqa: E731
    tokens = jax.block_until_ready(result())  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(result())
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times), np.asarray(jax.tree.leaves(tokens)[0])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--methods", nargs="+", default=[*FILTERS, *DRAWS], choices=[*FILTERS, *DRAWS])
    ap.add_argument("--distributions", nargs="+", default=["flat", "peaked"], choices=["flat", "peaked"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--branches", nargs="+", default=["static", "traced"], choices=["static", "traced"])
    ap.add_argument("--breakdown", action="store_true", help="also time the noise, each filter and the bare draw")
    ap.add_argument(
        "--trace",
        help="a Perfetto trace of 3 calls of each method in DIR/<logits>-<method> "
        "(benchmarks/trace_summary.py summarises one)",
    )
    a = ap.parse_args(argv)
    print(f"device {jax.devices()[0].device_kind}, {a.rows} rows x {a.vocab} vocabulary, median of {a.repeats}")
    rng = np.random.default_rng(0)
    for dist in a.distributions:
        logits = jnp.asarray(logits_of(dist, a.rows, a.vocab, rng))
        for how in a.branches:  # static: decided on the host; traced: a lax.cond per branch on the device

            def fn(batch, how=how):
                return jax.jit(functools.partial(sample, branches=branches_of(batch) if how == "static" else None))

            greedy = mixed_batch(a.rows, a.vocab, True)
            greedy_ms, _ = timed(fn(greedy), logits, jax.device_put(greedy), repeats=a.repeats)
            print(f"{dist:>7} {'all greedy':>12}: {greedy_ms:8.3f} ms  ({how} branches)")
            reference = None
            for method in a.methods:
                os.environ["CAPSTAN_SAMPLING_FILTERS"] = method  # read when the sampler is traced
                mixed = mixed_batch(a.rows, a.vocab, False)
                ms, tokens = timed(fn(mixed), logits, jax.device_put(mixed), repeats=a.repeats)
                reference = tokens if reference is None else reference
                same = (
                    "same tokens"
                    if np.array_equal(tokens, reference)
                    else f"{int(np.sum(tokens != reference))} rows differ (float rounding at a threshold?)"
                )
                print(f"{dist:>7} {method:>12}: {ms:8.3f} ms  {ms / greedy_ms:5.2f}x greedy  {same}")
                if a.trace:
                    with jax.profiler.trace(f"{a.trace}/{dist}-{method}", create_perfetto_trace=True):
                        timed(fn(mixed), logits, jax.device_put(mixed), repeats=3)
            os.environ.pop("CAPSTAN_SAMPLING_FILTERS", None)
        if a.breakdown:
            breakdown(logits, mixed_batch(a.rows, a.vocab, False), a.methods, a.repeats)


if __name__ == "__main__":
    main()
