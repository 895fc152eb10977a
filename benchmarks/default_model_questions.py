"""One-line questions at the API's defaults (no sampling field, no max_tokens) to a running `capstan serve`, as a
new user asks them: seconds, tokens and finish_reason of each answer, and the whole answer to read (issue 67 asks
for "stop" within 30 s each, on topic). The last line counts the answers that did not.

capstan serve &   # the default model
python benchmarks/default_model_questions.py --url http://127.0.0.1:8000/v1 --rounds 3

--offline asks an offline LLM instead (the default model), all rounds in one batched LLM.chat call, each round a
seed of its own, with --sampling's fields over the model's defaults: how candidate defaults were compared.

python benchmarks/default_model_questions.py --offline --rounds 3 --max-tokens 400 --sampling '{"dry_multiplier": 0.8}'"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from openai import OpenAI

QUESTIONS = [
    # facts
    "What is the capital of France?",
    "Who wrote Romeo and Juliet?",
    "Name a primary color.",
    "What is the boiling point of water?",
    "How many days are in a week?",
    "What is the largest planet in our solar system?",
    # greetings, in several languages
    "Hello!",
    "Say hello in Spanish.",
    "Bonjour, comment ça va ?",
    "Hallo, wie geht es dir?",
    "Ciao! Come stai?",
    "Say good morning in Japanese.",
    # arithmetic
    "What is 2 + 2?",
    "What is 12 times 7?",
    "What is 100 divided by 4?",
    "What is 15% of 200?",
    # lists
    "List three fruits.",
    "Give me five animals that live in the ocean.",
    "List the days of the week.",
    # definitions
    "What is photosynthesis?",
    "Define the word 'ephemeral'.",
    "What is a black hole?",
    # translations
    "Translate 'thank you' into French.",
    "How do you say 'cat' in German?",
    "Translate 'good night' into Italian.",
    # short poems
    "Write a haiku about the sea.",
    "Write a two-line poem about the moon.",
    # code
    "Write a Python function that adds two numbers.",
    "How do I print hello world in JavaScript?",
    "Write a SQL query that selects all rows from a table named users.",
    # advice
    "Give me a tip for sleeping better.",
    "Tell me a joke.",
]


def offline(a: argparse.Namespace) -> None:
    """Every round's questions in one LLM.chat call: round r samples with seed r."""
    from capstan import LLM

    started = time.monotonic()
    llm = LLM(max_model_len=2048, max_num_seqs=32)
    defaults = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=a.max_tokens, **json.loads(a.sampling))
    print(f"loaded in {time.monotonic() - started:.0f} s; sampling: {defaults}", flush=True)
    asked = [(r, q) for r in range(a.rounds) for q in QUESTIONS]
    params = [dataclasses.replace(defaults, seed=r) for r, _ in asked]
    started = time.monotonic()
    outputs = llm.chat([[{"role": "user", "content": q}] for _, q in asked], params, use_tqdm=False)
    seconds = time.monotonic() - started
    failed, tokens = [], 0
    for (round_, question), output in zip(asked, outputs, strict=True):
        answer = output.outputs[0]
        tokens += len(answer.token_ids)
        if answer.finish_reason != "stop":
            failed.append((round_, question))
        print(f"{round_} {question} -> {len(answer.token_ids):5d} tokens {answer.finish_reason}: {answer.text!r}")
    print(f"{len(asked) - len(failed)} of {len(asked)} answers ended with 'stop' ({tokens} tokens, {seconds:.0f} s);")
    print(f"not: {failed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before an answer counts as not ending")
    ap.add_argument("--limit-s", type=float, default=30.0, help="an answer slower than this counts as failed")
    ap.add_argument("--offline", action="store_true", help="an offline LLM, not a server (--url is not used)")
    ap.add_argument("--max-tokens", type=int, default=400, help="--offline: each answer's limit")
    ap.add_argument("--sampling", default="{}", help="--offline: SamplingParams fields (JSON) over the defaults")
    a = ap.parse_args()
    if a.offline:
        return offline(a)
    client = OpenAI(base_url=a.url, api_key="unused", timeout=a.timeout, max_retries=0)
    failed, asked = [], 0
    for round_ in range(a.rounds):
        for question in QUESTIONS:
            started = time.monotonic()
            asked += 1
            try:
                r = client.chat.completions.create(model=a.model, messages=[{"role": "user", "content": question}])
                assert r.usage is not None, "capstan reports every answer's usage"
                finish, answer = r.choices[0].finish_reason, r.choices[0].message.content or ""
                outcome = f"{r.usage.completion_tokens:5d} tokens {finish}: {answer!r}"
            except Exception as e:  # a timeout is the finding, not a crash
                finish, outcome = None, f"no answer ({type(e).__name__})"
            seconds = time.monotonic() - started
            if finish != "stop" or seconds > a.limit_s:
                failed.append((round_, question))
            print(f"{seconds:6.1f} s {question} -> {outcome}", flush=True)
    print(f"{asked - len(failed)} of {asked} answers ended with 'stop' within {a.limit_s:g} s; not: {failed}")


if __name__ == "__main__":
    main()
