"""Access to the transformers reference vectors copied into tests/data/golden (see its README in shared/)."""

import json
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).parent / "data" / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "reference.json").is_file())


def reference(case: str) -> dict:
    return json.loads((GOLDEN / case / "reference.json").read_text())


def reference_logits(case: str, i: int) -> np.ndarray:
    return np.load(GOLDEN / case / "reference.npz")[f"logits_{i}"]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def greedy_agreement_length(ref: dict, i: int) -> int:
    """Greedy tokens are owed up to (and including) the first step whose top-2 margin is below 1e-3."""
    margins = ref["step_top2_margins"][i]
    for step, m in enumerate(margins):
        if m < 1e-3:
            return step + 1
    return len(margins)
