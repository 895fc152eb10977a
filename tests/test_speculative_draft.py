"""Speculative decoding with a draft model: outputs are token for token those of plain decoding whatever the draft
(the target itself, the target cut to two of its three layers, another architecture with the same vocabulary); a
draft equal to the target has every proposal accepted, greedy and seeded sampling alike, which checks the draft's
own KV cache and its catch-up; sampled outputs are distributed as the target's; bad configurations are refused
naming the field."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from golden import GOLDEN
from safetensors.numpy import load_file, save_file
from speculative_cases import ENGINE, GRAMMAR, PARAMS, PROMPTS, same_outputs

from capstan.runtime.cli import build_parser
from capstan.runtime.config import DEFAULT_MODEL
from capstan.runtime.engine.llm import LLM
from capstan.runtime.sampling.sampling_params import SamplingParams
from capstan.runtime.speculative_config import SpeculativeConfig

LLAMA = GOLDEN / "llama-s11"
LONG = "the quick brown fox jumps over the lazy dog " * 2  # 57 tokens: 3 full pages, found cached when run again
# one continuous batch of speculating rows and rows that decode plainly (penalties, a grammar)
ALL_PROMPTS = PROMPTS + [LONG, "Name: "]
ALL_PARAMS = PARAMS + [SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True), GRAMMAR]


def draft_config(model, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(model), num_speculative_tokens=k)


def generate_all(llm):
    return llm.generate(ALL_PROMPTS, ALL_PARAMS, use_tqdm=False)


def write_cut_checkpoint(source, out, num_layers: int) -> None:
    """source's checkpoint with only its first num_layers layers: a draft that agrees with it sometimes."""
    out.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json") and not f.name.startswith("reference"):
            shutil.copy(f, out / f.name)
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=num_layers)))
    tensors = load_file(source / "model.safetensors")
    kept = {n: t for n, t in tensors.items() if not n.startswith("model.layers.") or int(n.split(".")[2]) < num_layers}
    save_file(kept, str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def plain():
    return LLM(str(LLAMA), warmup=False, **ENGINE)  # compiles what it uses, no more


@pytest.fixture(scope="module")
def baseline(plain):
    return generate_all(plain)


@pytest.fixture(scope="module")
def same_draft():
    return LLM(str(LLAMA), warmup=False, speculative_config=draft_config(LLAMA), **ENGINE)


@pytest.fixture(scope="module")
def cut_draft(tmp_path_factory):
    """The target cut to two layers drafts for it, in a pool of 14 pages of 8: too few for 4 running sequences of
    ~45 tokens, so some are preempted and recomputed."""
    path = tmp_path_factory.mktemp("llama-s11-2-layers")
    write_cut_checkpoint(LLAMA, path, num_layers=2)
    return LLM(str(LLAMA), warmup=False, speculative_config=draft_config(path), num_pages=14, page_size=8, **ENGINE)


def reset_counters(llm):
    s = llm.engine.speculator
    s.draft_tokens = s.accepted_tokens = s.drafts = 0
    s.accepted_per_pos = [0] * s.k


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(baseline, same_draft):
    e = same_draft.engine
    for _ in range(2):  # the second time the prompts' full pages come from the prefix cache
        reset_counters(same_draft)
        same_outputs(baseline, generate_all(same_draft))
        assert e.speculator.draft_tokens > 0 and e.speculator.accepted_tokens == e.speculator.draft_tokens
    assert e.stats().prefix_cache_hit_tokens > 0
    e.pool.check_all_free()


def test_with_the_gpus_programs_a_draft_equal_to_the_target_has_every_proposal_accepted(
    baseline, same_draft, monkeypatch
):
    """On GPUs the draft's and the verify step's sampling branches are decided on the host (greedy, sampled,
    general): the same tokens as the CPU's traced programs, every proposal of a draft equal to the target accepted,
    plain greedy batches included."""
    import capstan.runtime.speculative.draft_model as draft_model
    import capstan.runtime.speculative.speculator as speculative

    used = []
    for module, name in ((draft_model, "draft_branches"), (speculative, "verify_branches")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda rows, backend, real=real: used.append(b := real(rows, "gpu")) or b)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain_greedy = [o for p in PROMPTS[:2] for o in same_draft.generate([p], greedy, use_tqdm=False)]
    e = same_draft.engine
    reset_counters(same_draft)
    same_outputs(baseline, generate_all(same_draft))
    same_outputs(plain_greedy, same_draft.generate(PROMPTS[:2], greedy, use_tqdm=False))
    assert e.speculator.draft_tokens > 0 and e.speculator.accepted_tokens == e.speculator.draft_tokens
    assert {speculative.GREEDY_SCAN, speculative.SAMPLED_SCANS[False], speculative.VERIFY_GENERAL} <= set(used)
    assert None not in used
    e.pool.check_all_free()


def test_metrics_count_the_proposed_and_accepted_tokens(same_draft):
    reset_counters(same_draft)
    for seed in (None, 7):  # greedy, then seeded sampling
        params = SamplingParams(max_tokens=9, temperature=0.0 if seed is None else 1.0, seed=seed, ignore_eos=True)
        out = same_draft.generate(["Answer: "], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 9
    # each: the prefill samples token 1; 4 proposed and accepted, the target's own 6th; the 2 that max_tokens leaves
    stats = same_draft.engine.stats()
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens) == (12, 12)
    # two proposals each (4 tokens, then 2), accepted whole: positions 0 and 1 four times, 2 and 3 twice
    assert stats.spec_drafts == 4 and stats.spec_accepted_per_pos == (4, 4, 2, 2)
    from capstan.runtime.server.metrics import ServerMetrics  # what /metrics exports of them

    text = ServerMetrics(same_draft.engine).render().decode()
    for line in (
        "capstan_spec_decode_draft_tokens_total 12.0",
        "capstan_spec_decode_drafts_total 4.0",
        'capstan_spec_decode_accepted_tokens_per_pos_total{position="0"} 4.0',
        'capstan_spec_decode_accepted_tokens_per_pos_total{position="3"} 2.0',
    ):
        assert line in text.splitlines(), line


def test_a_draft_that_disagrees_leaves_the_outputs_unchanged_through_preemption(baseline, cut_draft):
    reset_counters(cut_draft)
    same_outputs(baseline, generate_all(cut_draft))
    e = cut_draft.engine
    assert 0 < e.speculator.accepted_tokens < e.speculator.draft_tokens
    assert e.scheduler.num_preemptions > 0
    e.pool.check_all_free()


def test_a_draft_of_another_architecture_leaves_the_outputs_unchanged(baseline):
    # Qwen3 with qk-norm, head_dim 32 (the target's is 16), random weights: the same vocabulary, nothing else
    llm = LLM(str(LLAMA), warmup=False, speculative_config=draft_config(GOLDEN / "qwen3-s13", k=3), **ENGINE)
    same_outputs(baseline, generate_all(llm))
    e = llm.engine
    assert e.speculator.draft_tokens > 0 and e.speculator.accepted_tokens < e.speculator.draft_tokens / 2
    e.pool.check_all_free()


def chi_square_p_value(statistic: float, dof: int) -> float:
    """Wilson-Hilferty: the chi-square tail through a normal one (ample for a test threshold)."""
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_outputs_are_distributed_as_the_targets(plain, cut_draft):
    """The first two tokens of 600 seeds, sampled at temperature 1 from the top 4, with proposals from a draft that
    is often rejected, against the target's own probabilities of the 16 pairs."""
    prompt = plain.tokenizer.encode("Answer: ")
    top4 = SamplingParams(max_tokens=1, temperature=0.0, logprobs=4)

    def next_probs(ids):
        lp = plain.generate([ids], top4, use_tqdm=False)[0].outputs[0].logprobs[0]
        p = np.exp([v.logprob for v in lp.values()])
        return dict(zip(lp, p / p.sum(), strict=True))  # top-k renormalises over the 4 it keeps

    first = next_probs(prompt)
    expected = {(a, b): pa * pb for a, pa in first.items() for b, pb in next_probs(prompt + [a]).items()}

    reset_counters(cut_draft)
    seeds = range(600)
    outs = cut_draft.generate(
        [prompt] * len(seeds),
        [SamplingParams(max_tokens=4, temperature=1.0, top_k=4, seed=s, ignore_eos=True) for s in seeds],
        use_tqdm=False,
    )
    e = cut_draft.engine
    # proposals of the 2nd and 3rd tokens, some rejected
    assert 0 < e.speculator.accepted_tokens < e.speculator.draft_tokens
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    assert set(pairs) <= set(expected)
    counts = {pair: pairs.count(pair) for pair in expected}
    small = [pair for pair in expected if expected[pair] * len(seeds) < 5]  # pooled: the test wants 5 expected
    cells = [([pair],) for pair in expected if pair not in small] + ([(small,)] if small else [])
    observed = np.array([sum(counts[p] for p in group) for (group,) in cells], float)
    wanted = np.array([sum(expected[p] for p in group) for (group,) in cells]) * len(seeds)
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    assert chi_square_p_value(statistic, len(cells) - 1) > 1e-3, (statistic, observed, wanted)


def test_a_draft_with_another_vocabulary_is_refused():
    with pytest.raises(
        ValueError, match="--speculative-config: model .*: vocab_size 4096 differs from the target's 512"
    ):
        LLM(str(LLAMA), warmup=False, speculative_config=draft_config(DEFAULT_MODEL), **ENGINE)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"method": "draft_model"}, 'method "draft_model" needs "model"'),
        ({"method": "draft_model", "model": "/no/such/draft"}, "model '/no/such/draft': no such checkpoint folder"),
        (
            {"model": "/no/such/draft"},
            "model '/no/such/draft': no such checkpoint folder",
        ),  # vLLM: a model means a draft
        ({"method": "ngram", "model": str(LLAMA)}, 'model applies to method "draft_model"'),
        ({"model": str(LLAMA), "prompt_lookup_min": 1}, "prompt_lookup_min: for method 'ngram' only"),
        ({"method": "medusa", "model": str(LLAMA)}, "method 'medusa' is not supported; supported: ngram, draft_model"),
    ],
)
def test_bad_draft_configs_are_refused_naming_the_field(fields, message):
    text = json.dumps(fields)
    with pytest.raises(ValueError, match="--speculative-config") as e:
        SpeculativeConfig.parse(text)
    assert message in str(e.value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", text])


def test_the_draft_flag_parses_as_vllm_spells_it():
    args = build_parser().parse_args(
        ["serve", "--speculative-config", json.dumps({"model": str(LLAMA), "num_speculative_tokens": 3})]
    )
    assert args.speculative_config == SpeculativeConfig(
        method="draft_model", model=str(LLAMA), num_speculative_tokens=3
    )
