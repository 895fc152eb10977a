"""Golden cases through the whole engine: batched with other requests, small pages, chunked prefill."""
import numpy as np
import pytest

from capstan.runtime.engine.llm import LLM
from capstan.runtime.engine.sampling_params import SamplingParams

from golden import CASES, GOLDEN, greedy_agreement_length, log_softmax, reference, reference_logits


@pytest.mark.parametrize("case", CASES)
def test_golden_greedy_tokens_and_logprobs_in_a_mixed_batch(case):
    ref = reference(case)
    # pages of 4 tokens and a 48-token step budget: the 130-token prompt is prefilled in chunks across many pages
    llm = LLM(str(GOLDEN / case), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=48, page_size=4,
              dtype="float32")
    rng = np.random.default_rng(0)
    fillers = [rng.integers(10, 500, size=int(n)).tolist() for n in (3, 60, 17, 90)]
    prompts = ref["prompts"] + fillers
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    noisy = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=5)
    outs = llm.generate(prompts, [greedy] * len(ref["prompts"]) + [noisy] * len(fillers))
    for i, (prompt, cont) in enumerate(zip(ref["prompts"], ref["greedy_continuations"])):
        got = outs[i].outputs[0]
        owed = greedy_agreement_length(ref, i)
        assert got.token_ids[:owed] == cont[:owed], f"{case} prompt {i}"
        expected = log_softmax(reference_logits(case, i))
        for k in range(owed):
            lp = got.logprobs[k][got.token_ids[k]].logprob
            assert abs(lp - expected[len(prompt) - 1 + k, cont[k]]) < 1e-4, f"{case} prompt {i} step {k}"
    llm.engine.pool.check_all_free()
