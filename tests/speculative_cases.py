"""What the speculative tests generate, and how outputs are compared with plain decoding's."""

import pytest

from capstan.runtime.sampling.grammar import StructuredOutput
from capstan.runtime.sampling.sampling_params import SamplingParams

ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
# greedy with logprobs, seeded sampling, n=2 with filters and a stop string, and penalties (decoded plainly)
PROMPTS = ["one two three one two three", "Answer: ", "a b c d a b c d", "Write JSON: "]
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, top_k=40, seed=9, n=2, stop=["zz"]),
    SamplingParams(max_tokens=30, temperature=0.0, presence_penalty=0.5, ignore_eos=True),
]
GRAMMAR = SamplingParams(max_tokens=40, seed=3, structured=StructuredOutput("regex", r"[a-z]{3,20}"))


def same_outputs(a, b):
    for x, y in zip(a, b, strict=True):
        for o, q in zip(x.outputs, y.outputs, strict=True):
            assert (o.token_ids, o.text, o.finish_reason) == (q.token_ids, q.text, q.finish_reason)
            if o.logprobs is not None:
                assert [list(lp) for lp in o.logprobs] == [list(lp) for lp in q.logprobs]
                for lx, ly in zip(o.logprobs, q.logprobs, strict=True):
                    assert [v.logprob for v in lx.values()] == pytest.approx([v.logprob for v in ly.values()], abs=1e-4)
