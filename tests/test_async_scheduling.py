"""Asynchronous scheduling (engine.py): a single step with prompt tokens is queued while the host reads the step
before it, its rows' unread tokens taken from that step's samples on the device. It must give every request the
tokens the synchronous engine gives (greedy, seeded and with penalties), through preemption, aborts and stops, compile nothing
after warm-up, and leak no page."""

import dataclasses

import numpy as np
import pytest
from golden import GOLDEN

from capstan.runtime.engine.llm import LLM
from capstan.runtime.engine.multi_step import decode_steps_fn
from capstan.runtime.engine.step import step_fn
from capstan.runtime.sampling.sampling_params import SamplingParams

MODEL = str(GOLDEN / "llama-s11")
SIZES = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=16)


@pytest.fixture(scope="module")
def engines():
    """The synchronous engine and the asynchronous one, counting the steps it queued asynchronously."""
    sync = LLM(MODEL, async_scheduling=False, warmup=True, **SIZES)
    queued = LLM(MODEL, async_scheduling=True, warmup=True, **SIZES)
    queued.async_steps = 0
    run = queued.engine._step_async

    def counted(*args):
        queued.async_steps += 1
        return run(*args)

    queued.engine._step_async = counted
    return sync, queued


def workload(seed: int, count: int = 24):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 500, size=int(rng.integers(1, 100))).tolist() for _ in range(count)]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(2, 30)),
            temperature=0.0 if i % 3 == 0 else 0.9,
            top_p=0.9 if i % 3 == 1 else 1.0,
            top_k=20 if i % 3 == 2 else 0,
            seed=1000 + i,
            min_tokens=2 if i % 5 == 0 else 0,
            logit_bias={7: 5.0} if i % 7 == 0 else None,
            stop_token_ids=[int(rng.integers(10, 500))] if i % 4 == 0 else None,
            ignore_eos=i % 2 == 0,
        )
        for i in range(count)
    ]
    return prompts, params


def results(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def test_queued_steps_give_the_synchronous_tokens(engines):
    sync, queued = engines
    prompts, params = workload(1)
    compiled = step_fn._cache_size(), decode_steps_fn._cache_size()
    before = queued.async_steps
    got = results(queued.generate(prompts, params))
    assert queued.async_steps - before >= 5  # the prefill phase ran queued
    assert (step_fn._cache_size(), decode_steps_fn._cache_size()) == compiled  # warm-up compiled them
    assert got == results(sync.generate(prompts, params))
    queued.engine.pool.check_all_free()


def test_all_greedy_steps_queue_as_the_plain_argmax(engines):
    sync, queued = engines
    prompts, _ = workload(2)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = queued.async_steps
    got = results(queued.generate(prompts, greedy))
    assert queued.async_steps > before
    assert got == results(sync.generate(prompts, greedy))


def test_queued_steps_with_penalties_count_the_unread_tokens(engines):
    """Repetition, frequency and presence penalties read each row's unread token from the step before on the
    device (engine/step.py): strong ones, on greedy rows too, so a token counted wrong changes the next."""
    sync, queued = engines
    prompts, params = workload(5)
    params = [
        dataclasses.replace(
            p,
            repetition_penalty=(1.0, 1.6, 1.3)[i % 3],
            frequency_penalty=(0.9, 0.0, 0.5)[i % 3],
            presence_penalty=(0.0, 0.0, 0.8)[i % 3] if i % 4 else 0.0,
            max_tokens=p.max_tokens + 10,
        )
        for i, p in enumerate(params)
    ]
    greedy = [dataclasses.replace(p, temperature=0.0, top_p=1.0, top_k=0) for p in params]  # the filters' draw
    for batch in (params, greedy):
        before = queued.async_steps
        got = results(queued.generate(prompts, batch))
        assert queued.async_steps - before >= 5  # the prefill phase ran queued, penalties and all
        assert got == results(sync.generate(prompts, batch))
    queued.engine.pool.check_all_free()


def logprobs_of(outs):
    """Each request's logprobs (None where it asked for none): every position's {token id: (logprob, rank)}."""
    positions = [o.outputs[0].logprobs for o in outs]
    return [None if ps is None else [{t: (lp.logprob, lp.rank) for t, lp in x.items()} for x in ps] for ps in positions]


def test_queued_steps_read_the_logprobs_their_rows_asked_for(engines):
    """A row's logprobs are read with its token when the queued step settles: the synchronous engine's logprobs,
    greedy, seeded and penalized rows beside rows that asked for none."""
    sync, queued = engines
    prompts, params = workload(6)
    params = [
        dataclasses.replace(
            p, logprobs=(2, None, 0, 5)[i % 4], repetition_penalty=1.3 if i % 5 == 1 else 1.0, ignore_eos=True
        )
        for i, p in enumerate(params)
    ]
    greedy = [dataclasses.replace(p, temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0) for p in params]
    for batch in (params, greedy):
        before = queued.async_steps
        got = queued.generate(prompts, batch)
        assert queued.async_steps - before >= 5  # the prefill phase ran queued, logprobs and all
        want = sync.generate(prompts, batch)
        assert results(got) == results(want)
        for g, w, p in zip(logprobs_of(got), logprobs_of(want), batch, strict=True):
            assert (g is None) == (p.logprobs is None)
            if g is None:
                continue
            assert len(g) == len(w) and [sorted(x) for x in g] == [sorted(x) for x in w]  # the same ids
            np.testing.assert_allclose(
                [v for x in g for v in x.values()], [v for x in w for v in x.values()], rtol=1e-5, atol=1e-5
            )
    queued.engine.pool.check_all_free()


def test_preemption_while_a_step_is_queued_gives_the_same_tokens():
    """A pool too small for the batch: sequences with an unread token are preempted and recomputed."""
    prompts, params = workload(3, count=16)
    small = dict(SIZES, num_pages=24)
    sync = LLM(MODEL, async_scheduling=False, **small)
    queued = LLM(MODEL, async_scheduling=True, **small)
    got = results(queued.generate(prompts, params))
    assert got == results(sync.generate(prompts, params))
    queued.engine.pool.check_all_free()
    penalized = [dataclasses.replace(p, repetition_penalty=1.5, frequency_penalty=0.7) for p in params]
    got = results(queued.generate(prompts, penalized))
    assert got == results(sync.generate(prompts, penalized))
    queued.engine.pool.check_all_free()


def test_an_abort_while_its_token_is_unread_ends_it_alone(engines):
    _, queued = engines
    e = queued.engine
    prompts, _ = workload(4, count=12)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(f"abort-{i}", p, params)
    for _ in range(100):  # bounded: until a step is queued with some sequence's token unread
        e.step()
        if e.pending is not None and any(s.pending_row is not None for s in e.requests.get("abort-0", [])):
            break
    assert e.pending is not None, "no step was queued asynchronously"
    assert e.abort("abort-0").outputs[0].finish_reason == "abort"
    finished = {}
    for _ in range(500):
        for o in e.step():
            if o.finished:
                finished[o.request_id] = o
        if not e.has_unfinished():
            break
    assert set(finished) == {f"abort-{i}" for i in range(1, 12)}
    assert all(o.outputs[0].finish_reason == "length" for o in finished.values())
    e.pool.check_all_free()
