"""lm-eval-harness against the real `capstan serve` on the default model (SmolLM2-135M-Instruct), as a user runs it:
local-completions scores multiple choice by loglikelihood (echo + logprobs, the served tokenizer through
/tokenizer_info and /tokenize), local-chat-completions answers by generate_until. The tasks and their data live in
tests/data/lm_eval, so nothing is downloaded."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TASKS = ROOT / "tests" / "data" / "lm_eval"
MODEL = "SmolLM2-135M-Instruct"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may wait for the default model's warm-up


@pytest.fixture(scope="module")
def smollm2(default_model_server):
    return default_model_server  # `capstan serve` with no flags, shared with the quick start's tests (conftest.py)


@pytest.fixture()
def lm_eval(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # read before `datasets` is imported: local json files only
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    return pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: run `make setup`")


def evaluate(lm_eval, model: str, task: str, base_url: str, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    started = time.monotonic()
    out = lm_eval.simple_evaluate(
        model=model,
        model_args={"model": MODEL, "base_url": base_url, "max_retries": 1, "num_concurrent": 2},
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
        **kwargs,
    )
    elapsed = time.monotonic() - started
    scores = {k: round(float(v), 4) for k, v in out["results"][task].items() if "," in k and "stderr" not in k}
    print(f"{task} via {model}: {scores} in {elapsed:.0f} s")  # (a hang: pytest-timeout; no timed assertion)
    return out


def test_local_completions_scores_multiple_choice_above_chance(smollm2, lm_eval):
    # lm-eval's default tokenizer backend ("auto") finds /tokenizer_info and tokenizes through the server: no download.
    out = evaluate(lm_eval, "local-completions", "capstan_basic_facts", f"{smollm2.url}/v1/completions", batch_size=16)
    assert out["config"]["model_args"]["model"] == MODEL
    samples = out["samples"]["capstan_basic_facts"]
    assert len(samples) == 30
    for sample in samples:  # one finite, negative loglikelihood per choice
        assert len(sample["resps"]) == len(sample["doc"]["choices"])
        assert all(logprob < 0 for [(logprob, _greedy)] in sample["resps"])
    results = out["results"]["capstan_basic_facts"]
    # Chance is 0.25; SmolLM2 scores 0.80 (acc) and 0.83 (acc_norm) here, greedy scoring being deterministic.
    assert results["acc,none"] >= 0.6 and results["acc_norm,none"] >= 0.6


def test_local_chat_completions_answers_until_a_newline(smollm2, lm_eval):
    out = evaluate(
        lm_eval,
        "local-chat-completions",
        "capstan_basic_answers",
        f"{smollm2.url}/v1/chat/completions",
        apply_chat_template=True,
    )
    samples = out["samples"]["capstan_basic_answers"]
    assert len(samples) == 6
    for sample in samples:  # English sentences, cut at the task's stop string
        [[text]] = sample["resps"]
        assert text.strip() and "\n" not in text
    # 4 of 6 here ("The capital of France is Paris."); at least one right shows scoring reads the answers.
    assert 0 < out["results"]["capstan_basic_answers"]["exact_match,last_word"] <= 1
