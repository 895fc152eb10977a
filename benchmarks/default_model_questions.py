"""One-line questions at the API's defaults (no sampling field, no max_tokens) to a running `capstan serve`, as a
new user asks them: seconds, tokens and finish_reason of each answer (issue 30 asks for "stop" within 30 s).

capstan serve &   # the default model
python benchmarks/default_model_questions.py --url http://127.0.0.1:8000/v1 --rounds 3"""

from __future__ import annotations

import argparse
import time

from openai import OpenAI

QUESTIONS = [
    "What is the capital of France?",
    "Who wrote Romeo and Juliet?",
    "What is 2 + 2?",
    "Name a primary color.",
    "What is the boiling point of water?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before an answer counts as not ending")
    a = ap.parse_args()
    client = OpenAI(base_url=a.url, api_key="unused", timeout=a.timeout, max_retries=0)
    for _ in range(a.rounds):
        for question in QUESTIONS:
            started = time.monotonic()
            try:
                r = client.chat.completions.create(model=a.model, messages=[{"role": "user", "content": question}])
                assert r.usage is not None, "capstan reports every answer's usage"
                outcome = (
                    f"{r.usage.completion_tokens:5d} tokens {r.choices[0].finish_reason}: "
                    f"{(r.choices[0].message.content or '')[:100]!r}"
                )
            except Exception as e:  # a timeout is the finding, not a crash
                outcome = f"no answer ({type(e).__name__})"
            print(f"{time.monotonic() - started:6.1f} s {question} -> {outcome}", flush=True)


if __name__ == "__main__":
    main()
