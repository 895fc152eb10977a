"""One request's failure is its own: the engine fails it, frees its pages and serves the others. Faults are
injected into one request's own state (as a bug only that request triggers would break it); only a fault of
the engine itself (its KV cache, a device step) stops the loop, and then /health and every request say so."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from golden import GOLDEN

from capstan.runtime.config import EngineConfig
from capstan.runtime.engine.llm import LLM
from capstan.runtime.sampling.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent / "server"))
from servers import START_TIMEOUT, ThreadServer  # noqa: E402

MODEL = str(GOLDEN / "qwen3-s13")
FLAGS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=4)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, **FLAGS)


def broken(*args, **kwargs):
    raise RuntimeError("a bug only this request triggers")


def broken_after(calls: int):
    """A stop matcher that works `calls` times, then breaks (so a stream has begun)."""
    count = 0

    def feed(text):
        nonlocal count
        count += 1
        if count > calls:
            broken()
        return text, False

    return feed


def run(engine, good: list[str]) -> tuple[dict, list[str]]:
    outputs: dict[str, list] = {}
    failed: list[str] = []
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        failed += [rid for rid, _ in engine.take_failed()]
    assert not engine.has_unfinished()
    for rid in good:
        assert outputs[rid][-1].finished and outputs[rid][-1].outputs[-1].finish_reason == "length"
    engine.pool.check_all_free()
    return outputs, failed


def add_three(engine, bad_prompt=None) -> None:
    rng = np.random.default_rng(7)
    engine.add_request("good-1", rng.integers(10, 400, 20).tolist(), PARAMS)
    engine.add_request(
        "bad", bad_prompt or rng.integers(10, 400, 30).tolist(), SamplingParams(**{**vars(PARAMS), "n": 2})
    )
    engine.add_request("good-2", rng.integers(10, 400, 9).tolist(), PARAMS)


@pytest.mark.parametrize("where", ["finishing", "building"])
def test_a_request_that_breaks_fails_alone_and_frees_its_pages(llm, where):
    engine = llm.engine
    add_three(engine)
    for seq in engine.requests["bad"]:
        if where == "finishing":
            seq.text.stop_matcher.feed = broken  # applying its sampled token raises
        else:
            seq.params.top_k = 2**40  # past validation (as a gap in it would be): its batch row cannot be built
    _, failed = run(engine, ["good-1", "good-2"])
    assert failed == ["bad"]


def test_a_request_that_breaks_the_scheduler_fails_alone(llm):
    engine = llm.engine
    add_three(engine, bad_prompt=list(range(10, 40)))
    for seq in engine.requests["bad"]:
        seq.token_ids[9] = "not a token"  # hashing its prompt pages for the prefix cache raises
    _, failed = run(engine, ["good-1", "good-2"])
    assert failed == ["bad"]


def test_offline_generate_raises_naming_the_prompt(llm):
    engine = llm.engine
    original = engine.prepare

    def prepare(request_id, prompt, params, lora_name=None):
        seqs = original(request_id, prompt, params, lora_name)
        if prompt == "boom":
            for seq in seqs:
                seq.text.stop_matcher.feed = broken
        return seqs

    engine.prepare = prepare
    try:
        with pytest.raises(RuntimeError, match="prompt 1 failed in the engine"):
            llm.generate(["fine", "boom"], PARAMS)
    finally:
        del engine.prepare
    engine.pool.check_all_free()
    assert llm.generate(["fine again"], PARAMS)[0].outputs[0].finish_reason == "length"


# ---- through the real server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """A server whose engine breaks every request that contains BOOM."""
    from capstan.runtime.engine.async_llm import AsyncLLM
    from capstan.runtime.server.app import build_app, make_context

    engine = AsyncLLM(EngineConfig(model=MODEL, **FLAGS, decode_steps=1))
    assert engine.wait_ready(START_TIMEOUT)
    original = engine.engine.prepare

    def prepare(request_id, prompt, params, lora_name=None):
        seqs = original(request_id, prompt, params, lora_name)
        if "BOOM" in (seqs[0].prompt_text or ""):
            for seq in seqs:
                seq.text.stop_matcher.feed = broken_after(3 if "later" in seqs[0].prompt_text else 0)
        return seqs

    engine.engine.prepare = prepare
    with ThreadServer(build_app(make_context(engine))) as s:
        yield s.url, engine
    engine.shutdown()


def test_the_server_answers_a_failed_request_and_serves_the_next(served):
    url, _ = served
    body = {"max_tokens": 8, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "BOOM now"}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "prompt": "BOOM later", "stream": True}, timeout=60
    ) as s:
        text = s.read().decode()
    assert '"request_failed"' in text and text.rstrip().endswith("data: [DONE]")
    ok = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "fine"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{url}/health").status_code == 200


def test_an_engine_fault_fails_health_and_every_request_says_so(served):
    url, engine = served
    engine.engine.kv = None  # the engine's own state is broken: its next step cannot run
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert "engine failed" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 503
    assert httpx.get(f"{url}/ready").status_code == 503
    later = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
