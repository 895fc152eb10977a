"""Speculative decoding (n-gram prompt lookup): outputs are token for token those of decoding without it, greedy
and seeded sampling alike, whatever is proposed; accepted proposals save target steps; rejected ones give their
pages back. Proposals here come from n-gram lookup, and from an oracle that knows the unspeculated output
(the upper bound of the machinery, as a draft identical to the target would be), whole or corrupted."""

from __future__ import annotations

import argparse

import pytest
from golden import GOLDEN
from speculative_cases import ENGINE, GRAMMAR, PARAMS, PROMPTS, same_outputs

from capstan.runtime.cli import build_parser
from capstan.runtime.engine.llm import LLM
from capstan.runtime.sampling.sampling_params import SamplingParams
from capstan.runtime.speculative.speculator import propose_ngram
from capstan.runtime.speculative_config import SpeculativeConfig


def test_ngram_lookup_takes_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 3, 3, 1) == [8, 5, 1]  # the latest [1 2 3]
    assert propose_ngram([7, 1, 2, 4, 2], 2, 3, 1) == [4, 2]  # no 3- or 2-gram: the unigram [2]
    assert propose_ngram([7, 1, 2, 4, 2], 2, 3, 2) == []
    assert propose_ngram([1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]  # what follows, repeating with its period
    assert propose_ngram([4, 4, 4], 3, 3, 1) == [4, 4, 4]
    assert propose_ngram([5], 4, 3, 1) == [] and propose_ngram([1, 2, 1], 0, 2, 1) == []


@pytest.fixture(scope="module")
def baseline():
    llm = LLM(str(GOLDEN / "llama-s11"), warmup=False, **ENGINE)  # compiles what it uses, no more
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False) + llm.generate(["Name: "], GRAMMAR, use_tqdm=False)


@pytest.fixture(scope="module")
def speculative_llm():
    return LLM(str(GOLDEN / "llama-s11"), speculative_config=SpeculativeConfig(num_speculative_tokens=4), **ENGINE)


def oracle(llm, baseline, corrupt_every: int = 0):
    """Proposes the unspeculated output from where the sequence is (every corrupt_every-th proposal wrong at its
    second token)."""
    futures = [r.prompt_token_ids + o.token_ids for r in baseline for o in r.outputs]
    calls = [0]

    def propose(tokens, k):
        calls[0] += 1
        for future in futures:
            if future[: len(tokens)] == tokens and len(future) > len(tokens):
                draft = future[len(tokens) : len(tokens) + k]
                if corrupt_every and calls[0] % corrupt_every == 0 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % 512
                return draft
        return []

    llm.engine.speculator.proposer = propose


@pytest.mark.parametrize("corrupt_every", [0, 2])
def test_outputs_are_those_of_plain_decoding_whatever_is_proposed(baseline, speculative_llm, corrupt_every):
    llm = speculative_llm
    llm.engine.speculator.draft_tokens = llm.engine.speculator.accepted_tokens = 0
    oracle(llm, baseline, corrupt_every)
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False) + llm.generate(["Name: "], GRAMMAR, use_tqdm=False)
    same_outputs(baseline, got)
    e = llm.engine
    assert e.speculator.draft_tokens > 0
    if corrupt_every:
        assert 0 < e.speculator.accepted_tokens < e.speculator.draft_tokens
    else:
        assert e.speculator.accepted_tokens == e.speculator.draft_tokens  # the draft is the target: all accepted
    e.pool.check_all_free()
    assert e.stats().spec_draft_tokens == e.speculator.draft_tokens


@pytest.mark.parametrize("programs", ["cpu", "gpu"])
def test_every_verify_program_keeps_the_outputs(speculative_llm, programs, monkeypatch):
    """Greedy, sampled and mixed batches (logprobs, penalties, filters) verified with the CPU's traced program and
    with the GPU's (its branches decided on the host) give plain decoding's tokens, proposals half corrupted."""
    import capstan.runtime.speculative.speculator as speculative

    used, real = [], speculative.verify_branches
    monkeypatch.setattr(
        speculative, "verify_branches", lambda chunks, backend: used.append(b := real(chunks, programs)) or b
    )
    llm, e = speculative_llm, speculative_llm.engine
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True)
    for prompts, params in ((PROMPTS[:3], greedy), (PROMPTS[:3], sampled), (PROMPTS, PARAMS)):
        e.speculator.proposer = lambda tokens, k: []  # no proposals: plain decoding
        plain = llm.generate(prompts, params, use_tqdm=False)
        oracle(llm, plain, corrupt_every=2)
        same_outputs(plain, llm.generate(prompts, params, use_tqdm=False))
    if programs == "gpu":
        assert set(used) == {speculative.GREEDY_SCAN, speculative.SAMPLED_SCANS[False], speculative.VERIFY_GENERAL}
    else:
        assert set(used) == {None}
    e.pool.check_all_free()


def test_ngram_lookup_and_preemption_keep_the_outputs(baseline):
    # a pool of 14 pages of 8 cannot hold 4 running sequences of ~45 tokens: some are preempted and recomputed
    llm = LLM(
        str(GOLDEN / "llama-s11"),
        num_pages=14,
        page_size=8,
        warmup=False,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1),
        **ENGINE,
    )
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    same_outputs(baseline[: len(PROMPTS)], got)
    assert llm.engine.speculator.draft_tokens > 0 and llm.engine.scheduler.num_preemptions > 0
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"method": "eagle"}', "method 'eagle' is not supported"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
        ('{"num_speculative_tokens": 17}', "num_speculative_tokens must be at most 16"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min (5) must not exceed"),
        ('{"k": 4}', "unknown field(s) k"),
        ('{"disable_by_batch_size": 1}', "disable_by_batch_size must be an integer of at least 2"),
        ('{"disable_by_batch_size": 2.5}', "disable_by_batch_size must be an integer of at least 2"),
        ("[4]", "must be a JSON object"),
        ("{", "not JSON"),
    ],
)
def test_bad_speculative_configs_are_refused_naming_the_field(text, message):
    with pytest.raises(ValueError, match="--speculative-config") as e:
        SpeculativeConfig.parse(text)
    assert message in str(e.value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", text])


def test_no_proposals_while_the_batch_is_at_disable_by_batch_size(baseline):
    """vLLM's disable_by_batch_size: while 2 or more sequences run, steps decode plainly (and a decode run queues its
    next dispatch ahead, as without speculation); once one is left it proposes again; outputs unchanged."""
    llm = LLM(
        str(GOLDEN / "llama-s11"),
        warmup=False,
        **ENGINE,
        speculative_config=SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=2),
    )
    e = llm.engine
    running, runs = [], []
    propose, continue_run = e.speculator.propose, e.multi_step.continue_run
    e.speculator.propose = lambda chunks, budget: running.append(len(e.scheduler.running)) or propose(chunks, budget)
    e.multi_step.continue_run = lambda: runs.append(1) or continue_run()
    oracle(llm, baseline)
    params = [PARAMS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]  # the second ends first
    plain = [baseline[0]] + LLM(str(GOLDEN / "llama-s11"), warmup=False, **ENGINE).generate(
        PROMPTS[1:2], params[1:], use_tqdm=False
    )
    got = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    same_outputs(plain, got)
    assert running and max(running) < 2  # proposals only once one sequence was left
    assert e.speculator.draft_tokens > 0 and runs  # and plain runs chained while two were
    e.pool.check_all_free()


def test_the_flag_parses():
    args = build_parser().parse_args(["serve", "--speculative-config", '{"num_speculative_tokens": 3}'])
    assert isinstance(args, argparse.Namespace) and args.speculative_config.num_speculative_tokens == 3


def test_a_step_without_proposals_decodes_one_dispatch_and_proposes_again(baseline, speculative_llm):
    """When nothing is proposed a step runs the plain multi-step decode, but never queues the run's next dispatch
    ahead (multi_step.py): every later step proposes again."""
    llm = speculative_llm
    e = llm.engine
    oracle(llm, baseline)
    propose, calls, runs = e.speculator.proposer, [0], []
    e.speculator.proposer = lambda tokens, k: (
        [] if (calls.__setitem__(0, calls[0] + 1) or calls[0] % 3 == 0) else propose(tokens, k)
    )
    continue_run = e.multi_step.continue_run
    e.multi_step.continue_run = lambda: runs.append(1) or continue_run()
    e.speculator.draft_tokens = e.speculator.accepted_tokens = 0
    try:  # one greedy sequence of 40 tokens: each third step has no proposal and decodes 16 plainly
        same_outputs(baseline[:1], llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False))
    finally:
        e.multi_step.continue_run = continue_run
    assert not runs and e.speculator.accepted_tokens > 0
    e.pool.check_all_free()
