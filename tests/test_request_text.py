"""The engine core sends token ids only and its frontend makes the text (RequestText): the same requests give the
same text, tokens, logprobs and finish reasons as the engine's own text, with stop strings (one choice of several
ending early), stop token ids, EOS, lengths and logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from capstan.runtime.config import EngineConfig
from capstan.runtime.engine.engine import LLMEngine
from capstan.runtime.engine.request_text import RequestText
from capstan.runtime.sampling.sampling_params import SamplingParams

CHECKPOINT = Path(__file__).parent / "data" / "golden" / "qwen3-s13"


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(
        EngineConfig(
            model=str(CHECKPOINT),
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            decode_steps=4,
            warmup=False,
        )
    )


def run(engine: LLMEngine, requests: list[tuple[str, str, SamplingParams]], in_frontend: bool) -> dict:
    """Each choice's (text, token ids, logprobs, finish_reason, stop_reason), made by the engine or as a frontend."""
    texts: dict[str, RequestText] = {}
    results: dict[tuple[str, int], list] = {}
    for rid, prompt, params in requests:
        request = engine.inputs.process(rid, prompt, params)
        request.text_in_engine = not in_frontend
        engine.enqueue(engine.make_sequences(request))
        texts[rid] = RequestText(engine.tokenizer, request, engine.eos_token_ids)
    open_ids = set(texts)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in open_ids:
                continue  # ended by the frontend already
            if in_frontend:
                finished_in_engine = out.finished
                stopped = texts[out.request_id].apply(out)
                if out.finished and not finished_in_engine:
                    engine.abort(out.request_id)
                for index in [] if out.finished else stopped:
                    engine.abort_choice(out.request_id, index)
            for c in out.outputs:
                r = results.setdefault((out.request_id, c.index), ["", [], [], None, None])
                r[0] += c.text
                r[1] += c.token_ids
                r[2] += [
                    sorted((t, round(lp.logprob, 4), lp.decoded_token) for t, lp in p.items()) for p in c.logprobs or []
                ]
                if c.finish_reason is not None:
                    r[3], r[4] = c.finish_reason, c.stop_reason
            if out.finished:
                open_ids.discard(out.request_id)
    return results


def test_frontend_text_equals_the_engines(engine):
    free = run(engine, [("probe", "The capital of France is", SamplingParams(max_tokens=40, temperature=0))], False)
    text, ids = free[("probe", 0)][0], free[("probe", 0)][1]
    assert len(text) > 12, text
    stop_mid, stop_token = text[5:9], ids[6]  # a stop string and a stop token id this model will meet
    requests = [
        ("greedy-stop", "The capital of France is", SamplingParams(max_tokens=40, temperature=0, stop=[stop_mid])),
        (
            "token-stop",
            "The capital of France is",
            SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_token]),
        ),
        (
            "sampled-n3",
            "Once upon a time",
            SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=7, stop=["e", "an"], logprobs=2),
        ),
        ("length", "Hello", SamplingParams(max_tokens=17, temperature=0.8, seed=3, logprobs=0)),
        ("ids-only", [1, 2, 3], SamplingParams(max_tokens=9, temperature=0, detokenize=False)),
        (
            "eos-skip-special",
            "Hi",
            SamplingParams(max_tokens=30, temperature=1.0, seed=11, skip_special_tokens=False, stop_token_ids=[0]),
        ),
    ]
    in_engine = run(engine, requests, in_frontend=False)
    in_frontend = run(engine, requests, in_frontend=True)
    assert in_frontend == in_engine
    assert in_engine[("greedy-stop", 0)][3:] == ["stop", stop_mid]
    assert in_engine[("token-stop", 0)][3:] == ["stop", stop_token]
    reasons = [in_engine[("sampled-n3", i)][3] for i in range(3)]
    assert "stop" in reasons, reasons  # at least one choice met "e" or "an" while others may run on
    assert engine.pool.num_used == 0 or engine.config.enable_prefix_caching
