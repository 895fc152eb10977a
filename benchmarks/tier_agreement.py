"""Do returning turns get the same tokens with the prefix cache's host-memory tier? (issue 33's check, CPU float32.)

The tests' conversations (tests/test_host_tier.py: 4 conversations of 3 turns, each resending its history plus 8 new
tokens; two greedy rows, two seeded sampled ones; a 48-page pool of 4-token pages) on three engines: a pool that
never evicts, the small pool without a tier (evicted prefixes recomputed) and the small pool with the tier. Per seed
the first two run once and the tier --reps times (the same engines throughout: later reps also find earlier reps'
pages in both tiers). Prints each run that parts from the never-evicting pool and where (output index, first
differing token), then the counts. A restored page with wrong bytes parts at any margin; rounding (a page computed by
another program: a prefill instead of a decode step) parts only at a near-tie.

python benchmarks/tier_agreement.py --seeds 0 1 2 3 4 5 6 7 8 9 --reps 4 --decode-steps 16"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np

from capstan.runtime.engine.llm import LLM
from capstan.runtime.sampling.sampling_params import SamplingParams

GOLDEN = Path(__file__).parent.parent / "tests" / "data" / "golden" / "llama-s11"
PAGE_BYTES = 2 * 3 * 2 * 16 * 4 * 4  # llama-s11's page: K and V, 3 layers, 2 KV heads of 16, 4 tokens, float32
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=12, ignore_eos=True),
]


def conversations(llm: LLM, seed: int, turns: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    histories = [rng.integers(10, 500, size=40).tolist() for _ in PARAMS]
    outputs = []
    for _ in range(turns):
        for i, o in enumerate(llm.generate(histories, PARAMS, use_tqdm=False)):
            outputs.append(o.outputs[0].token_ids)
            histories[i] = histories[i] + o.outputs[0].token_ids + rng.integers(10, 500, size=8).tolist()
    return outputs


def parts(answers: list[list[int]], reference: list[list[int]]) -> list[tuple[int, int]]:
    """(output index, first differing token) of each answer that differs from the reference's."""
    return [
        (i, next((j for j, (x, y) in enumerate(zip(a, r, strict=False)) if x != y), min(len(a), len(r))))
        for i, (a, r) in enumerate(zip(answers, reference, strict=True))
        if a != r
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(GOLDEN))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--reps", type=int, default=3, help="tier runs per seed")
    ap.add_argument("--decode-steps", type=int, default=16)
    a = ap.parse_args()
    small = dict(
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        page_size=4,
        num_pages=48,
        decode_steps=a.decode_steps,
    )
    never_evicts = LLM(a.model, **{**small, "num_pages": 512})
    recompute = LLM(a.model, **small)
    tier = LLM(a.model, kv_offloading_size=64 * PAGE_BYTES / (1 << 30), **small)
    count: collections.Counter = collections.Counter()
    for seed in a.seeds:
        reference = conversations(never_evicts, seed)
        recomputed = parts(conversations(recompute, seed), reference)
        count["recompute_runs_parting"] += bool(recomputed)
        if recomputed:
            print(json.dumps(dict(seed=seed, recompute_parts=recomputed)), flush=True)
        for rep in range(a.reps):
            restored = parts(conversations(tier, seed), reference)
            count["tier_runs_parting"] += bool(restored)
            if restored:
                print(json.dumps(dict(seed=seed, rep=rep, tier_parts=restored)), flush=True)
    s = tier.engine.stats()
    print(
        json.dumps(
            dict(
                decode_steps=a.decode_steps,
                recompute_runs=len(a.seeds),
                tier_runs=len(a.seeds) * a.reps,
                **count,
                host_hit_tokens=s.kv_offload_hit_tokens,
                failed_loads=s.kv_offload_failed_loads,
                preemptions=s.preemptions,
            )
        )
    )


if __name__ == "__main__":
    main()
