"""Accuracy of llama.cpp on the local lm-eval multiple-choice task (tests/data/lm_eval), scored from llama.cpp's own
logits the way lm-eval scores an API model: sum of the continuation's token logprobs, argmax over the choices (acc)
and over logprob per character (acc_norm). Run with the interpreter that has llama-cpp-python:

    /work/venv-gguf/bin/python benchmarks/llamacpp_task_accuracy.py MODEL.gguf

Why not lm-eval against `python -m llama_cpp.server`: its echoed prompt logprobs (0.3.36) leave out the generated
token, so lm-eval's slice drops the continuation's last token, and their values are not the model's (e.g. " the"
after "What color is" at -9.9); lm-eval's `gguf` model scores 0.27 there, chance being 0.25. Measured here: acc 0.80, acc_norm 0.83, as Capstan.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from llama_cpp import Llama

TASK = Path(__file__).parents[1] / "tests" / "data" / "lm_eval" / "basic_facts.jsonl"


def continuation_logprob(llm: Llama, context: str, continuation: str) -> float:
    # lm-eval's split: the context alone, then what the whole adds (so a merge across the boundary stays whole).
    context_ids = llm.tokenize(context.encode(), add_bos=False, special=False)
    whole_ids = llm.tokenize((context + continuation).encode(), add_bos=False, special=False)
    continuation_ids = whole_ids[len(context_ids) :]
    llm.reset()
    llm.eval(context_ids + continuation_ids)
    logits = np.asarray(llm.scores[: llm.n_tokens], dtype=np.float64)
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    first = len(context_ids)  # row i predicts token i + 1
    return float(sum(logprobs[i - 1, t] for i, t in enumerate(continuation_ids, start=first)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the .gguf file")
    parser.add_argument("--verbose", action="store_true", help="print every choice's loglikelihood")
    args = parser.parse_args()
    llm = Llama(args.model, n_ctx=512, logits_all=True, verbose=False)
    docs = [json.loads(line) for line in TASK.read_text().splitlines()]
    acc = acc_norm = 0
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"  # the task's doc_to_text
        choices = [f" {c}" for c in doc["choices"]]  # lm-eval's default target_delimiter
        scores = [continuation_logprob(llm, context, c) for c in choices]
        acc += int(np.argmax(scores)) == doc["answer"]
        # lm-eval normalises by the choice's characters, without the delimiter.
        acc_norm += int(np.argmax([s / len(c) for s, c in zip(scores, doc["choices"], strict=True)])) == doc["answer"]
        if args.verbose:  # per-choice loglikelihoods, to compare with lm-eval's samples from Capstan
            print(doc["question"], " ".join(f"{s:.2f}" for s in scores))
    print(
        f"llama.cpp on {TASK.name}: acc {acc / len(docs):.4f}, acc_norm {acc_norm / len(docs):.4f} ({len(docs)} docs)"
    )


if __name__ == "__main__":
    main()
