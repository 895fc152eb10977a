"""Golden cases through the whole engine: batched with other requests, small pages, chunked prefill."""

import numpy as np
import pytest
from golden import CASES, GOLDEN, greedy_agreement_length, log_softmax, reference, reference_logits

from capstan.runtime.engine.llm import LLM
from capstan.runtime.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize("case", CASES)
def test_golden_greedy_tokens_and_logprobs_in_a_mixed_batch(case):
    check_golden_in_a_mixed_batch(case)


@pytest.mark.parametrize("case", ["llama-s11", "qwen3-s13", "gemma3-s14"])
def test_golden_through_the_gpu_kernels_interpreted_on_cpu(case, monkeypatch):
    """The GPU path's wiring, in CI: query blocks from the batch builder, the ragged kernel for prefill chunks,
    mixed steps, Gemma-3's sliding windows and float32 decode (Pallas interpreted). llama-s11 is the sensitive
    case (its attention scale x1.5 moves logprobs by 0.42); gemma3-s14's attention logits are near zero (x1.5 moves
    them by 4e-5), so it shows the window path runs, while tests/test_attention.py checks windows' values."""
    import jax

    from capstan.runtime import attention

    monkeypatch.setattr(attention, "KERNELS_INTERPRETED_ON_CPU", True)
    jax.clear_caches()  # steps traced with the reference attention must be traced again
    try:
        check_golden_in_a_mixed_batch(case)
    finally:
        jax.clear_caches()


def check_golden_in_a_mixed_batch(case):
    ref = reference(case)
    # pages of 4 tokens and a 48-token step budget: the 130-token prompt is prefilled in chunks across many pages
    llm = LLM(
        str(GOLDEN / case), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=48, page_size=4, dtype="float32"
    )
    rng = np.random.default_rng(0)
    fillers = [rng.integers(10, 500, size=int(n)).tolist() for n in (3, 60, 17, 90)]
    prompts = ref["prompts"] + fillers
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    noisy = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=5)
    outs = llm.generate(prompts, [greedy] * len(ref["prompts"]) + [noisy] * len(fillers))
    for i, (prompt, cont) in enumerate(zip(ref["prompts"], ref["greedy_continuations"], strict=True)):
        got = outs[i].outputs[0]
        owed = greedy_agreement_length(ref, i)
        assert got.token_ids[:owed] == cont[:owed], f"{case} prompt {i}"
        expected = log_softmax(reference_logits(case, i))
        for k in range(owed):
            lp = got.logprobs[k][got.token_ids[k]].logprob
            assert abs(lp - expected[len(prompt) - 1 + k, cont[k]]) < 1e-4, f"{case} prompt {i} step {k}"
    llm.engine.pool.check_all_free()
    return llm
