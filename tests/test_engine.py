"""The engine's promises: no compilation after warm-up, prefix caching, preemption, aborts, stops, seeds, n > 1."""

import types

import numpy as np
import pytest
from golden import GOLDEN

from capstan.runtime.engine.llm import LLM
from capstan.runtime.engine.multi_step import decode_steps_fn
from capstan.runtime.engine.step import step_fn
from capstan.runtime.kv.page_pool import chained_page_hashes, page_hash
from capstan.runtime.sampling.sampling_params import InvalidRequestError, SamplingParams
from capstan.runtime.scheduling.sequence import Sequence

MODEL = str(GOLDEN / "llama-s11")


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, page_size=16, warmup=True)


def random_prompts(rng, count, low=1, high=120):
    return [rng.integers(10, 500, size=int(rng.integers(low, high))).tolist() for _ in range(count)]


def test_a_hundred_random_requests_compile_nothing_after_warmup(llm):
    rng = np.random.default_rng(1)
    compiled = step_fn._cache_size(), decode_steps_fn._cache_size()
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 40)),
            temperature=float(rng.uniform(0, 1.5)),
            top_k=int(rng.integers(0, 50)),
            top_p=float(rng.uniform(0.5, 1)),
            ignore_eos=True,
            logprobs=int(rng.integers(0, 3)) if rng.random() < 0.3 else None,
            presence_penalty=0.5 if rng.random() < 0.2 else 0.0,
        )
        for _ in range(100)
    ]
    outs = llm.generate(random_prompts(rng, 100), params)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert (step_fn._cache_size(), decode_steps_fn._cache_size()) == compiled
    llm.engine.pool.check_all_free()


def test_shared_prefix_is_computed_once_and_changes_nothing(llm):
    rng = np.random.default_rng(2)
    prefix = rng.integers(10, 500, size=100).tolist()
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(first, greedy)
    cached = llm.generate(second, greedy)[0]
    assert cached.num_cached_tokens == 96  # every full 16-token page of the shared 100 tokens
    uncached = LLM(
        MODEL,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        page_size=16,
        enable_prefix_caching=False,
        warmup=False,
    ).generate(second, greedy)[0]
    assert uncached.num_cached_tokens == 0
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids


def test_a_sequences_page_hashes_are_the_chain_of_page_hash_computed_once_however_asked():
    tokens = list(range(1000, 1070))  # 4 full pages of 16 and 6 tokens
    chain, parent = [], b"root"
    for k in range(4):
        parent = page_hash(parent, tokens[16 * k : 16 * (k + 1)])
        chain.append(parent)
    assert chained_page_hashes(b"root", tokens, 16) == chain
    seq = Sequence("r", 0, tokens[:40], SamplingParams(), 0, 0.0, None, 8)
    seq.lora = types.SimpleNamespace(hash_root=b"root")  # (the adapter's hash parents the first page)
    assert seq.full_page_hashes(16, 1) == chain[:1]
    seq.token_ids += tokens[40:]  # output tokens extend the memo from where it stopped
    assert seq.full_page_hashes(16, 4) == chain and seq.full_page_hashes(16, 2) == chain[:2]
    assert seq.hashed_pages == chain


def test_three_hundred_requests_with_aborts_and_preemption_free_every_page():
    llm = LLM(MODEL, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, page_size=4, num_pages=80)
    engine, rng = llm.engine, np.random.default_rng(3)
    prompts = random_prompts(rng, 300, 1, 60)
    choices = set()
    for i, p in enumerate(prompts):
        n = int(rng.choice([1, 1, 1, 2, 3]))
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=int(rng.integers(1, 60)), ignore_eos=True, n=n))
        choices |= {(f"r{i}", k) for k in range(n)}
    finished, steps = {}, 0
    while engine.has_unfinished() and steps < 5000:
        for out in engine.step():
            for o in out.outputs:
                if o.finish_reason:
                    finished[(out.request_id, o.index)] = o.finish_reason
        if rng.random() < 0.1:
            victim = f"r{int(rng.integers(0, 300))}"
            out = engine.abort(victim)
            for o in out.outputs if out else []:
                finished[(victim, o.index)] = o.finish_reason
        steps += 1
    assert not engine.has_unfinished()
    assert set(finished) == choices  # every choice of every request ended, and said how
    assert set(finished.values()) <= {"length", "abort"} and "abort" in finished.values()
    assert engine.scheduler.num_preemptions > 0
    engine.pool.check_all_free()


def test_a_seeded_request_is_the_same_alone_and_in_a_batch(llm):
    rng = np.random.default_rng(4)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate("The quick brown fox", seeded)[0].outputs[0].text
    others = [SamplingParams(temperature=1.0, max_tokens=int(rng.integers(5, 30)), ignore_eos=True) for _ in range(16)]
    batch = llm.generate(random_prompts(rng, 16) + ["The quick brown fox"], others + [seeded])
    assert batch[-1].outputs[0].text == alone


def test_stop_strings_are_held_back_and_never_emitted(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    text = llm.generate([5, 6, 7], greedy)[0].outputs[0].text
    stop = text[10:13]
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    tokens = (
        llm.generate([9, 8], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    )
    out = llm.generate([9, 8], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[tokens[4]]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[4]
    assert out.token_ids == tokens[: tokens.index(tokens[4]) + 1]
    eos = sorted(llm.engine.eos_token_ids)[0]
    forced = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, logit_bias={eos: 100.0})
    out = llm.generate([9, 8], forced)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 6 and out.token_ids[-1] == eos
    assert llm.generate([9, 8], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].finish_reason == "length"


def test_n_choices_share_the_prompt_pages(llm):
    engine = llm.engine
    prompt = list(range(10, 80))  # 70 tokens: 4 full pages of 16 are shared
    engine.add_request("fork", prompt, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=9, ignore_eos=True))
    parent, *children = engine.requests["fork"]
    outs = {}

    def step():
        for out in engine.step():
            for o in out.outputs:
                outs.setdefault(o.index, []).extend(o.token_ids)

    while parent.pending_forks:  # the parent's prefill (two chunks of the 64-token budget); then it forks
        step()
    assert all(c.pages[:4] == parent.pages[:4] for c in children)
    assert all(engine.pool.ref_count[p] == 3 for p in parent.pages[:4])
    while engine.has_unfinished():
        step()
    assert sorted(outs) == [0, 1, 2] and all(len(t) == 8 for t in outs.values())
    assert len({tuple(t) for t in outs.values()}) > 1  # independent random streams
    engine.pool.check_all_free()


@pytest.mark.parametrize(
    "prompt, params, param",
    [
        (list(range(300)), SamplingParams(), "prompt"),
        ([1, 2], SamplingParams(max_tokens=255), "max_tokens"),
        ([1, 2], SamplingParams(n=17), "n"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=0), "top_p"),
        ([1, 2], SamplingParams(logprobs=21), "logprobs"),
        ([1, 2], SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        ([], SamplingParams(), "prompt"),
        ([1, 99999], SamplingParams(), "prompt"),
    ],
)
def test_bad_requests_are_refused_before_queueing(llm, prompt, params, param):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request("bad", prompt, params)
    assert e.value.param == param
    assert "bad" not in llm.engine.requests


def test_prompt_logprobs_cover_every_prompt_token(llm):
    out = llm.generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 5
    assert all(6 + i in out.prompt_logprobs[1 + i] for i in range(4))


def test_multi_step_decoding_gives_the_single_step_tokens(llm):
    single = LLM(MODEL, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, page_size=16, decode_steps=1)
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, 6)
    params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=int(rng.integers(3, 30)), ignore_eos=True, logprobs=1)
        for i in range(6)
    ]
    a, b = llm.generate(prompts, params), single.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize("programs", ["cpu", "gpu"])
def test_chained_dispatches_change_no_token_and_free_every_page(programs, monkeypatch):
    """A free batch's run queues its next dispatch before it reads the last one's tokens (multi_step.py): rows
    that stop mid-run (a stop token found a dispatch late, max_tokens), an abort and a request arriving mid-run give
    the single-step tokens, and every page comes back; with the CPU's programs and with the GPU's (every branch
    static: sampled rows always filter)."""
    import capstan.runtime.engine.multi_step as multi_step

    real = multi_step.scan_branches
    monkeypatch.setattr(multi_step, "scan_branches", lambda params, backend: real(params, programs))
    flags = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=4)
    chained, single = LLM(MODEL, decode_steps=4, **flags), LLM(MODEL, decode_steps=1, **flags)
    rng = np.random.default_rng(7)
    prompts = random_prompts(rng, 6, 1, 40)
    params = [
        SamplingParams(
            temperature=0.7 * (i % 2),
            seed=i,
            max_tokens=int(rng.integers(20, 60)),
            ignore_eos=True,
            logprobs=1 if i < 3 else None,
            top_p=0.8 if i == 1 else 1.0,
        )
        for i in range(6)
    ]
    reference = single.generate(prompts, params)
    for i in (0, 3):  # stop on a token first sampled mid-output: found in a dispatch the next was queued behind
        first = reference[i].outputs[0].token_ids
        params[i].stop_token_ids = [next(t for t in first[9:] if t not in first[:9])]
    reference = [o.outputs[0] for o in single.generate(prompts, params)]
    engine, runs = chained.engine, []
    continue_run = engine.multi_step.continue_run
    engine.multi_step.continue_run = lambda: runs.append(1) or continue_run()
    for i in range(5):
        engine.add_request(f"r{i}", prompts[i], params[i])
    outputs: dict[str, list] = {}
    finish: dict[str, str] = {}
    late_added = aborted = False
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(t for o in out.outputs for t in o.token_ids)
            for o in out.outputs:
                if o.finish_reason:
                    finish[out.request_id] = o.finish_reason
        if engine.multi_step.ahead is not None and not late_added:  # arrives while a dispatch is queued
            engine.add_request("r5", prompts[5], params[5])
            late_added = True
        elif engine.multi_step.ahead is not None and late_added and not aborted and "r5" in engine.requests:
            engine.abort("r4")
            aborted = True
    assert runs and aborted and not engine.has_unfinished()
    for i in (0, 1, 2, 3, 5):
        assert outputs[f"r{i}"] == reference[i].token_ids, i
        assert finish[f"r{i}"] == reference[i].finish_reason
    assert finish["r0"] == finish["r3"] == "stop"
    assert outputs["r4"] == reference[4].token_ids[: len(outputs["r4"])]  # its tokens up to the abort
    engine.pool.check_all_free()


def test_a_plain_greedy_run_takes_its_own_program_and_the_single_step_tokens(monkeypatch):
    import capstan.runtime.engine.multi_step as multi_step
    import capstan.runtime.sampling.programs as sampling_programs

    flags = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=4)
    chained, single = LLM(MODEL, decode_steps=4, **flags), LLM(MODEL, decode_steps=1, **flags)
    chosen, real = [], multi_step.scan_branches
    monkeypatch.setattr(multi_step, "scan_branches", lambda *a: chosen.append(real(*a)) or chosen[-1])
    prompts = random_prompts(np.random.default_rng(8), 5, 1, 40)
    params = SamplingParams(max_tokens=37, ignore_eos=True, temperature=0.0)
    assert [o.outputs[0].token_ids for o in chained.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in single.generate(prompts, params)
    ]
    assert chosen and set(chosen) == {sampling_programs.GREEDY_SCAN}
    chained.engine.pool.check_all_free()


def test_a_full_batch_runs_on_while_requests_wait_and_admits_them_when_a_row_frees():
    flags = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, page_size=4)
    chained, single = LLM(MODEL, decode_steps=4, **flags), LLM(MODEL, decode_steps=1, **flags)
    prompts = random_prompts(np.random.default_rng(9), 4, 1, 30)
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=i) for i, n in enumerate((41, 13, 30, 22))
    ]
    runs = []
    continue_run = chained.engine.multi_step.continue_run
    chained.engine.multi_step.continue_run = lambda: (
        runs.append(len(chained.engine.scheduler.waiting)) or continue_run()
    )
    assert [o.outputs[0].token_ids for o in chained.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in single.generate(prompts, params)
    ]
    assert any(runs)  # some dispatch was queued ahead while a request waited
    chained.engine.pool.check_all_free()


def test_a_batch_with_rows_free_takes_shorter_dispatches_so_an_arrival_waits_at_most_two(monkeypatch):
    """While fewer than max_num_seqs sequences run, a dispatch takes decode_steps_with_room steps: a request
    arriving waits for the dispatch under way and the one queued behind it, 2 x 2 steps here rather than 2 x 16;
    a full batch takes decode_steps. Tokens are the single-step engine's; nothing compiles after warm-up."""
    import capstan.runtime.engine.multi_step as multi_step

    flags = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, page_size=4)
    chained = LLM(MODEL, decode_steps=16, decode_steps_with_room=2, warmup=True, **flags)
    single = LLM(MODEL, decode_steps=1, **flags)
    prompts = random_prompts(np.random.default_rng(12), 4, 1, 30)
    params = [SamplingParams(max_tokens=90, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(4)]
    reference = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    real, dispatched = multi_step.decode_steps_fn, []
    compiled = real._cache_size()

    def spy(*args, num_steps, **kwargs):  # records each dispatch's rows and steps, runs the real program
        dispatched.append((int(np.count_nonzero(args[3])), num_steps))
        return real(*args, num_steps=num_steps, **kwargs)

    monkeypatch.setattr(multi_step, "decode_steps_fn", spy)
    engine, outputs = chained.engine, {f"r{i}": [] for i in range(4)}
    waited = None  # r0's tokens from r2's arrival to r2's first token
    for i in (0, 1):
        engine.add_request(f"r{i}", prompts[i], params[i])
    for _ in range(400):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs[out.request_id].extend(t for o in out.outputs for t in o.token_ids)
        if "r2" not in engine.requests and len(outputs["r0"]) >= 8 and engine.multi_step.ahead is not None:
            engine.add_request("r2", prompts[2], params[2])  # arrives while a dispatch is queued behind one
            arrived_at = len(outputs["r0"])
        if "r2" in engine.requests and outputs["r2"] and waited is None:
            waited = len(outputs["r0"]) - arrived_at
            engine.add_request("r3", prompts[3], params[3])  # fills the batch
    assert not engine.has_unfinished()
    assert [outputs[f"r{i}"] for i in range(4)] == reference
    assert waited is not None and waited <= 2 * 2 + 1  # the two dispatches, then the step that admits it
    assert (2, 2) in dispatched and (4, 16) in dispatched
    assert {steps for rows, steps in dispatched if rows < 4} == {2}
    assert real._cache_size() == compiled
    engine.pool.check_all_free()


@pytest.mark.parametrize("room", [0, 5])
def test_decode_steps_with_room_out_of_range_is_refused_by_name(room):
    from capstan.runtime.config import EngineConfig

    with pytest.raises(ValueError, match=r"decode_steps_with_room must be between 1 and decode_steps \(4\)"):
        EngineConfig(model=MODEL, decode_steps=4, decode_steps_with_room=room).validate()


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_decode_row_buckets_give_the_tokens_of_full_rows(decode_steps):
    """Steps of a few decodes run at their row bucket (1, 4, 16 here), not max_num_seqs rows: greedy and seeded
    outputs are those of the full rows, while the batch shrinks from six rows through four to one."""
    from capstan.runtime.scheduling.batch import row_buckets

    assert row_buckets(16) == [1, 4, 16] and row_buckets(32) == [1, 4, 16, 32] and row_buckets(1) == [1]
    flags = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, page_size=16, decode_steps=decode_steps)
    bucketed, full = LLM(MODEL, decode_row_buckets=True, **flags), LLM(MODEL, decode_row_buckets=False, **flags)
    assert bucketed.engine.builder.row_buckets == [1, 4, 16] and full.engine.builder.row_buckets == [16]
    rng = np.random.default_rng(11)
    prompts = random_prompts(rng, 6, 1, 40)
    params = [
        SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=5 + 9 * i, ignore_eos=True) for i in range(6)
    ]
    shapes = []
    real = bucketed.engine.builder.build
    bucketed.engine.builder.build = lambda *a, **k: shapes.append(k.get("rows")) or real(*a, **k)
    assert [o.outputs[0].token_ids for o in bucketed.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in full.generate(prompts, params)
    ]
    assert {1, 4} <= set(shapes)  # the batch ran at the small buckets on its way down
    alone = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert (
        bucketed.generate(prompts[0], alone)[0].outputs[0].token_ids
        == full.generate(prompts[0], alone)[0].outputs[0].token_ids
    )
    bucketed.engine.pool.check_all_free()


@pytest.mark.parametrize("programs", ["cpu", "gpu"])
def test_penalties_run_inside_multi_step_decoding_with_the_single_step_tokens(programs, monkeypatch):
    """Repetition, presence and frequency penalties keep multi-step decoding: the scan carries each row's token
    counts, adds every step's samples and hands them to the run's next dispatch; greedy and seeded outputs are the
    single-step ones (with the CPU's programs and with the GPU's, whose penalties have programs of their own)."""
    import capstan.runtime.engine.multi_step as multi_step
    import capstan.runtime.sampling.programs as sampling_programs

    real = multi_step.scan_branches
    chosen: list = []
    monkeypatch.setattr(multi_step, "scan_branches", lambda p, backend: chosen.append(real(p, programs)) or chosen[-1])
    flags = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=4)
    chained, single = LLM(MODEL, decode_steps=4, **flags), LLM(MODEL, decode_steps=1, **flags)
    rng = np.random.default_rng(12)
    prompts = random_prompts(rng, 5, 1, 40)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=41, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, presence_penalty=0.6, frequency_penalty=0.4, max_tokens=37),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5, max_tokens=30, logprobs=1),
        SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.1, top_p=0.8, max_tokens=45),
        SamplingParams(temperature=0.0, max_tokens=33),  # no penalties, in the same batch
    ]
    for p in params:
        p.ignore_eos = True
    runs = []
    plan = chained.engine.multi_step.plan
    chained.engine.multi_step.plan = lambda chunks: runs.append(r := plan(chunks)) or r
    assert [o.outputs[0].token_ids for o in chained.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in single.generate(prompts, params)
    ]
    assert any(r is not None for r in runs)  # the penalised batch ran several steps a dispatch
    expected = sampling_programs.PENALTY_SCANS.values() if programs == "gpu" else [sampling_programs.SCAN_BRANCHES]
    assert chosen and set(chosen) <= set(expected)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=40, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in chained.generate(prompts[:1], greedy)]  # one row: its own bucket
    assert alone == [o.outputs[0].token_ids for o in single.generate(prompts[:1], greedy)]
    chained.engine.pool.check_all_free()
