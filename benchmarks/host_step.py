"""The host's share of a single engine step, without the device: scheduling, building the inputs, applying results.

Every single step (the prefill phase, and any step with a prompt chunk in it) is built and applied on the host
while the device waits: `throughput.py --timeline` measured ~10 ms of host work a prefill-phase step of the 8B
shape on an H200 (building 4.6-5.0, fetching 2.0-2.1, applying and scheduling 3.1-3.6), the same at TP=1 and TP=2,
so it is a larger share of the faster TP=2 step. This runs the engine's own scheduler, BatchBuilder and
apply_step on a workload's steps with the tiny shape's random weights, the device's results replaced by random
tokens (no forward runs; the inputs are still put on this machine's first device), and prints the median
milliseconds of each part by kind of step.

  python3 benchmarks/host_step.py                  # 256 x (256 -> 32): the 8B runs' prefill phase, then decodes
  python3 benchmarks/host_step.py --vocab 128256   # the 8B shape's vocabulary (the sampler's arrays are per row)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.limits import MAX_LOGPROBS  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402
from capstan.runtime.sampling.sampler import PromptLogprobs, SampleResult, StepOutputs  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402


def device_results(rows: int, tokens: int, vocab: int, rng: np.random.Generator) -> StepOutputs:
    """What engine.fetch returns for a step (its results on the host), with random tokens as the sampled ones."""
    return jax.device_get(
        StepOutputs(
            SampleResult(
                tokens=jnp.asarray(rng.integers(0, vocab, rows), jnp.int32),
                logprob=jnp.zeros(rows, jnp.float32),
                rank=jnp.ones(rows, jnp.int32),
                top_ids=jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
                top_logprobs=jnp.zeros((rows, MAX_LOGPROBS), jnp.float32),
            ),
            PromptLogprobs(
                logprob=jnp.zeros(tokens, jnp.float32),
                rank=jnp.ones(tokens, jnp.int32),
                top_ids=jnp.zeros((tokens, MAX_LOGPROBS), jnp.int32),
                top_logprobs=jnp.zeros((tokens, MAX_LOGPROBS), jnp.float32),
            ),
        )
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=None, help="the model's vocabulary (default: the tiny shape's)")
    ap.add_argument("--prefix-caching", action="store_true")
    args = ap.parse_args(argv)
    cfg = shape_config("tiny")
    if args.vocab:
        cfg = dataclasses.replace(cfg, vocab_size=args.vocab)
    engine = LLMEngine(
        EngineConfig(
            model=str(DEFAULT_MODEL),
            dtype="float32",
            max_model_len=args.prompt_len + args.output_len + 1,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.prefix_caching,
        ),
        model=random_model(cfg, "float32"),
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    for i in range(args.requests):
        engine.add_request(str(i), rng.integers(0, cfg.vocab_size, args.prompt_len).tolist(), params)
    parts: dict[str, dict[str, list[float]]] = {}  # kind -> part -> seconds per step
    while engine.has_unfinished():
        t0 = time.perf_counter()
        chunks = engine.scheduler.schedule()
        t1 = time.perf_counter()
        kind = "prefill phase" if any(c.seq.in_prefill for c in chunks) else "decodes"
        small = engine.builder.small_step(chunks)  # a few decodes: a row bucket, as engine.step builds them
        chunks, _ = engine._build(chunks, bucket=small, rows=small)
        t2 = time.perf_counter()
        out = device_results(small or args.max_num_seqs, args.max_num_batched_tokens, cfg.vocab_size, rng)
        t3 = time.perf_counter()
        engine.apply_step(chunks, out)
        t4 = time.perf_counter()
        for part, s in (("schedule", t1 - t0), ("build", t2 - t1), ("apply", t4 - t3), ("all", t4 - t0 - (t3 - t2))):
            parts.setdefault(kind, {}).setdefault(part, []).append(s)
    figures: dict = {"device": str(jax.devices()[0].device_kind), "rows": args.max_num_seqs}
    for kind, by_part in parts.items():
        figures[f"{kind} steps"] = len(by_part["all"])
        for part, seconds in by_part.items():
            figures[f"{kind} {part} ms"] = 1000 * statistics.median(seconds)
    for k, v in figures.items():
        print(f"{k:>26}: {v:.3f}" if isinstance(v, float) else f"{k:>26}: {v}")
    return figures


if __name__ == "__main__":
    main()
