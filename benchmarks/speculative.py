"""Speculative decoding on a named shape with random weights: ms per output token and acceptance, plain decoding
against
  ngram         n-gram prompt lookup;
  oracle        a proposer that returns the target's own plain output (the verification machinery's upper bound,
                with no proposal cost);
  draft-target  a draft model that is the target itself (acceptance 1: the draft-model path's upper bound, paying
                for a full-size draft);
  draft-small   a small draft model (--draft-shape, given the target's vocabulary), random weights of its own,
per batch size.

python benchmarks/speculative.py --shape tiny --draft-shape tiny --batch-sizes 1 4 --tokens 64
python benchmarks/speculative.py --shape llama-3-8b --draft-shape llama-3.2-1b --batch-sizes 1 8 --tokens 64
Random weights make n-gram acceptance whatever the model's loops give; the prompts repeat a random phrase, the
kind of input (code, a quoted document) n-gram lookup is for. A small draft with random weights of its own agrees
with the random target only by accident (random models of small weights tend to repeat their input, so the two
agree on those loops and rarely elsewhere): its row measures what proposing costs, not what a trained draft
(Llama-3.2-1B for Llama-3-8B: the same vocabulary) would save."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402
from throughput import Timeline, peaked  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402
from capstan.runtime.speculative_config import SpeculativeConfig  # noqa: E402

METHODS = ("ngram", "oracle", "draft-target", "draft-small")


def run(engine: LLMEngine, prompts, params, timeline: Timeline | None = None) -> tuple[float, list[list[int]]]:
    ids = [f"s{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in timeline.step(engine) if timeline else engine.step():
            outputs[out.request_id] += out.outputs[0].token_ids if out.outputs else []
    return time.perf_counter() - start, [outputs[r] for r in ids]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--smallest-bucket", type=int, default=16)
    ap.add_argument(
        "--draft-shape",
        default=None,
        help="draft-small's shape, given the target's vocabulary (default: llama-3.2-1b for llama-3-8b, else tiny)",
    )
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument(
        "--peaked",
        type=float,
        default=0.0,
        metavar="GAIN",
        help="scale the output rows of 512 random tokens by GAIN (e.g. 8): the model then picks among "
        "them with clear margins, as a trained model's confident tokens are, so bf16 rounding "
        "(a verify chunk's against a decode step's) no longer flips near-ties",
    )
    ap.add_argument("--timeline", action="store_true", help="each method's step kinds, split as throughput.py's")
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: float32 on CPUs, bfloat16 elsewhere (where a verify chunk's rounding may flip near-ties)",
    )
    a = ap.parse_args(argv)
    dtype = a.dtype if a.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = shape_config(a.shape)
    model = random_model(cfg, dtype)
    if a.peaked:
        model = peaked(model, a.peaked, cfg.vocab_size)
    a.draft_shape = a.draft_shape or ("llama-3.2-1b" if a.shape == "llama-3-8b" else "tiny")
    draft_cfg = dataclasses.replace(shape_config(a.draft_shape), vocab_size=cfg.vocab_size)
    drafts = {"draft-target": model}
    if "draft-small" in a.methods:
        drafts["draft-small"] = random_model(draft_cfg, dtype, seed=1)
    rng = np.random.default_rng(0)
    ngram = SpeculativeConfig(num_speculative_tokens=a.k, prompt_lookup_max=4, prompt_lookup_min=2)
    configs = {"ngram": ngram, "oracle": ngram}
    for name, shape in (("draft-target", a.shape), ("draft-small", a.draft_shape)):  # the models are given below
        configs[name] = SpeculativeConfig(method="draft_model", model=f"random {shape}", num_speculative_tokens=a.k)
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    print(
        f"shape {a.shape} {dtype}, {jax.devices()[0].device_kind}, K={a.k}, {a.tokens} output tokens a request, greedy"
    )
    if "draft-small" in a.methods:
        print(
            f"draft-small: shape {a.draft_shape} ({draft_cfg.num_layers} layers, hidden {draft_cfg.hidden_size}) "
            f"with the target's vocabulary ({cfg.vocab_size}), random weights of its own: its acceptance is what two "
            "unrelated random models happen to agree on (low, or high where both just repeat these repeating "
            "prompts), not what a trained draft gets; its time is what proposing costs"
        )
    for batch in a.batch_sizes:
        phrase = [rng.integers(0, cfg.vocab_size, 24).tolist() for _ in range(batch)]
        prompts = [p * 6 for p in phrase]  # 144 tokens: a phrase repeated, as quoted text or code repeats
        engines = {}
        for name in ("plain", *a.methods):
            e = LLMEngine(
                EngineConfig(
                    model=str(DEFAULT_MODEL),
                    dtype=dtype,
                    max_model_len=160 + a.tokens + 8,
                    max_num_seqs=max(batch, 1),
                    max_num_batched_tokens=max(256, batch * (a.k + 1)),
                    smallest_token_bucket=a.smallest_bucket,
                    enable_prefix_caching=False,
                    speculative_config=configs.get(name),
                ),
                model=model,
                draft_model=drafts.get(name),
            )
            started = time.perf_counter()
            e.warmup()
            print(f"batch {batch:>3}: {name} engine warmed up in {time.perf_counter() - started:.0f} s", flush=True)
            engines[name] = e
        run(engines["plain"], prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
        timeline = Timeline(engines["plain"]) if a.timeline else None
        plain_s, plain_out = run(engines["plain"], prompts, params, timeline)
        futures = [p + o for p, o in zip(prompts, plain_out, strict=True)]

        by_prompt = {
            tuple(p): f for p, f in zip(prompts, futures, strict=True)
        }  # one lookup a row: the oracle costs no host time

        prompt_len = len(prompts[0])

        def oracle(tokens, k, by_prompt=by_prompt, prompt_len=prompt_len):
            f = by_prompt.get(tuple(tokens[:prompt_len]))
            return f[len(tokens) : len(tokens) + k] if f is not None and f[: len(tokens)] == tokens else []

        if "oracle" in engines:
            speculator = engines["oracle"].speculator
            assert speculator is not None  # every method's engine speculates
            speculator.proposer = oracle
        print(
            f"batch {batch:>3}: {'plain':>12} {1000 * plain_s / a.tokens:8.3f} ms/token "
            f"({batch * a.tokens / plain_s:8.0f} tok/s)",
            flush=True,
        )
        for kind, line in timeline.report().items() if timeline else ():
            print(f"    {kind}: {line}")
        for name in a.methods:
            e = engines[name]
            spec = e.speculator
            assert spec is not None  # every method's engine speculates
            run(e, prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
            spec.draft_tokens = spec.accepted_tokens = 0
            timeline = Timeline(e) if a.timeline else None
            seconds, out = run(e, prompts, params, timeline)
            # identical in float32 (tests/test_speculative.py); in bfloat16 a verify chunk's logits round unlike a
            # decode step's, so near-ties may flip: the share of outputs identical to plain decoding's is reported
            same = sum(o == p for o, p in zip(out, plain_out, strict=True)) / len(out)
            rate = spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else 0.0
            print(
                f"batch {batch:>3}: {name:>12} {1000 * seconds / a.tokens:8.3f} ms/token "
                f"({batch * a.tokens / seconds:8.0f} tok/s, acceptance {rate:.2f}, identical outputs {same:.2f})",
                flush=True,
            )
            for kind, line in timeline.report().items() if timeline else ():
                print(f"    {kind}: {line}")
        del engines


if __name__ == "__main__":
    main()
