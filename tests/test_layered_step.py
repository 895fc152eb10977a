"""A step run layer by layer (engine/layered_step.py: serve's stand-in for the first shapes while their whole programs
compile) gives the whole program's tokens, and its logprobs to float32 rounding, prefill chunks and decode steps
alike, and never compiles on the request path."""

from __future__ import annotations

import jax
import pytest
from compile_watch import compiles_in_this_thread

from capstan.runtime.config import DEFAULT_MODEL
from capstan.runtime.engine.llm import LLM
from capstan.runtime.engine.warmup import BackgroundWarmup
from capstan.runtime.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="stand-ins run layer by layer on CPU only")
FLAGS = dict(max_model_len=128, max_num_seqs=3, max_num_batched_tokens=64)  # not test_warmup.py's shapes
REQUESTS: list[tuple[str | list[int], SamplingParams]] = [
    (list(range(100, 140)), SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)),
    ("The capital of France is", SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)),
    ("Once upon a time", SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
    ("Hello", SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.3, seed=3, ignore_eos=True)),
]


def outputs(llm: LLM) -> tuple[list[list[int]], list[float]]:
    """Each request's tokens; every logprob asked for, in order."""
    outs = llm.generate([p for p, _ in REQUESTS], [s for _, s in REQUESTS], use_tqdm=False)
    logprobs = [lp.logprob for o in outs for position in o.outputs[0].logprobs or [] for lp in position.values()]
    return [list(o.outputs[0].token_ids) for o in outs], logprobs


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_steps_run_layer_by_layer_give_the_whole_programs_tokens_and_logprobs(quantization):
    llm = LLM(str(DEFAULT_MODEL), quantization=quantization, **FLAGS)
    engine = llm.engine
    first, _ = engine._programs()
    warming = BackgroundWarmup(engine._precision)
    warming.compile_now(first)  # their stand-ins; the thread that would compile the whole programs never starts
    engine.warming = warming
    assert warming.standing_in() == len(first) == len(engine.layered) == 2
    with compiles_in_this_thread() as compiles:
        served = outputs(llm)
    assert compiles == [], "a request waited for a compilation (a whole program's)"
    engine.pool.check_all_free()
    tokens, logprobs = outputs(LLM(str(DEFAULT_MODEL), quantization=quantization, **FLAGS, warmup=True))
    assert served[0] == tokens
    # XLA fuses across a layer's edges in the whole program: the same operations, rounded apart by ~1e-5
    assert len(logprobs) == 2 * 12 * 3 and served[1] == pytest.approx(logprobs, rel=1e-4, abs=1e-4)
