"""How peaked a random model's next-token rows are under throughput.py --peaked GAIN (the LM head's rows of 512 random
tokens scaled by GAIN), against trained models' rows: the top token's probability and the top 20's, at T 1.

python benchmarks/peaked_rows.py --shape llama-3.2-1b --gains 0 4 8

Each gain: four requests of 32 random prompt tokens, greedy, their first two tokens' top-20 logprobs (float32)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402
from throughput import peaked  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--gains", type=float, nargs="+", default=[0.0, 4.0, 8.0])
    a = ap.parse_args()
    cfg = shape_config(a.shape)
    base = random_model(cfg, "float32")
    for gain in a.gains:
        engine = LLMEngine(
            EngineConfig(
                model=str(DEFAULT_MODEL),
                dtype="float32",
                max_model_len=128,
                max_num_seqs=4,
                max_num_batched_tokens=128,
                warmup=False,
            ),
            model=peaked(base, gain, cfg.vocab_size) if gain else base,
        )
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=20, ignore_eos=True, detokenize=False)
        for i in range(4):
            engine.add_request(f"r{i}", rng.integers(0, cfg.vocab_size, 32).tolist(), params)
        positions, finished = [], 0
        for _ in range(100):  # bounded: four requests of two tokens finish in a few steps
            for out in engine.step():  # each output carries the logprobs of the tokens new since the last
                positions += out.outputs[0].logprobs or []
                finished += out.finished
            if finished == 4:
                break
        top1, top20 = [], []
        for position in positions:
            p = np.sort(np.exp([lp.logprob for lp in position.values()]))[::-1]
            top1.append(p[0])
            top20.append(p[:20].sum())
        print(
            f"{a.shape} gain {gain:g}: top token {min(top1):.4f}..{max(top1):.4f}, "
            f"top 20 {min(top20):.4f}..{max(top20):.4f} ({len(top1)} rows)",
            flush=True,
        )
        del engine


if __name__ == "__main__":
    main()
