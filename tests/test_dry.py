"""DRY sampling (sampling/dry.py): the jitted penalty agrees with the plain-Python definition, it runs in the sampler
and inside multi-step decoding with the single-step tokens, and its fields are bounded by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden import GOLDEN

from capstan.runtime.engine.llm import LLM
from capstan.runtime.limits import DRY_MAX_MATCH
from capstan.runtime.sampling.dry import DryParams, dry_penalty, dry_penalty_reference, pack_bits, recent_tokens
from capstan.runtime.sampling.sampling_params import InvalidRequestError, SamplingParams

MODEL = str(GOLDEN / "llama-s11")
V = 24
penalty = jax.jit(dry_penalty, static_argnums=2)


def params(rows, **fields) -> DryParams:
    S = len(rows)
    column = lambda name, dtype: np.array([r[name] for r in rows], dtype)  # noqa: E731
    return DryParams(
        multiplier=column("multiplier", np.float32),
        base=column("base", np.float32),
        allowed_length=column("allowed_length", np.int32),
        last_n=column("last_n", np.int32),
        breakers=np.stack([pack_bits(sorted(r["breaker_ids"]), V) for r in rows]) if S else None,
        any_dry=np.bool_(True),
    )


def window(contexts, W) -> np.ndarray:
    recent = np.full((len(contexts), W), V, np.int32)
    for r, c in enumerate(contexts):
        c = c[-W:]
        recent[r, W - len(c) :] = c
    return recent


def test_the_jitted_penalty_is_the_definitions_on_random_contexts():
    """Random contexts (small alphabets repeat a lot), breakers, windows, allowed lengths, bases and multipliers;
    a window of 32 tokens, and one of 160 with repeats longer than the match cap (DRY_MAX_MATCH)."""
    rng = np.random.default_rng(0)
    for W, trials in ((32, 60), (160, 10)):
        for trial in range(trials):
            S = 4
            contexts = [rng.integers(0, 3 if trial % 2 else V, int(rng.integers(3, W + 20))).tolist() for _ in range(S)]
            if W > 100:  # a long loop: matches past the cap
                contexts[0] = [1, 2, 3, 4] * 40
            rows = [
                dict(
                    multiplier=float(rng.choice([0.0, 0.8, 2.0])),
                    base=float(rng.choice([1.0, 1.75, 3.0])),
                    allowed_length=int(rng.integers(0, 4)),
                    last_n=int(rng.choice([-1, 0, 10, 25, 1000])),
                    breaker_ids=set(rng.choice(V, int(rng.integers(0, 3)), replace=False).tolist()),
                )
                for _ in range(S)
            ]
            got = np.asarray(penalty(jnp.asarray(window(contexts, W)), params(rows), V))
            for r, (context, row) in enumerate(zip(contexts, rows, strict=True)):
                want = dry_penalty_reference(context, V, window=W, **row)
                np.testing.assert_allclose(got[r], want, rtol=1e-5, err_msg=f"{context[-W:]} {row}")


def test_the_example_of_llama_cpp():
    """llama.cpp's worked example: after `a b c c b c y a b c`, `c` extends `a b c` (3), `y` extends `b c` (2)."""
    a, b, c, y = 1, 2, 3, 4
    row = dict(multiplier=1.0, base=2.0, allowed_length=2, last_n=-1, breaker_ids=set())
    want = dry_penalty_reference([a, b, c, c, b, c, y, a, b, c], V, **row)
    assert want[c] == 2.0 and want[y] == 1.0 and np.count_nonzero(want) == 2
    got = penalty(jnp.asarray(window([[a, b, c, c, b, c, y, a, b, c]], 16)), params([row]), V)
    np.testing.assert_array_equal(np.asarray(got)[0], want)
    breaker = dict(row, breaker_ids={b})  # `b` ends what a match may span: the suffix is `c` alone, shorter than 2
    assert not np.any(dry_penalty_reference([a, b, c, c, b, c, y, a, b, c], V, **breaker))


def test_the_window_is_the_historys_last_tokens():
    history = np.full((2, 8), V, np.int32)
    history[0, :5] = [5, 6, 7, 8, 9]
    np.testing.assert_array_equal(np.asarray(recent_tokens(jnp.asarray(history), V, 3)), [[7, 8, 9], [V, V, V]])
    assert DRY_MAX_MATCH == 64


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(dry_multiplier=-0.1), "dry_multiplier"),
        (dict(dry_multiplier=float("nan")), "dry_multiplier"),
        (dict(dry_base=0.5), "dry_base"),
        (dict(dry_base=float("inf")), "dry_base"),
        (dict(dry_allowed_length=-1), "dry_allowed_length"),
        (dict(dry_allowed_length=65), "dry_allowed_length"),
        (dict(dry_penalty_last_n=-2), "dry_penalty_last_n"),
        (dict(dry_sequence_breakers=["x"] * 10_000), "dry_sequence_breakers"),
        (dict(dry_sequence_breakers=["x" * 1_000_000]), "dry_sequence_breakers"),
        (dict(dry_sequence_breakers=[""]), "dry_sequence_breakers"),
    ],
)
def test_out_of_range_fields_are_refused_by_name(fields, param):
    with pytest.raises(InvalidRequestError, match=param) as e:
        SamplingParams(**fields).validate(vocab_size=V, max_n=1)
    assert e.value.param == param


@pytest.fixture(scope="module")
def engines():
    flags = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=4)
    return LLM(MODEL, decode_steps=4, **flags), LLM(MODEL, decode_steps=1, **flags)


def test_dry_ends_a_loop_and_keeps_multi_step_decodings_tokens(engines):
    """The random checkpoint's greedy output loops; DRY breaks the loop. Multi-step decoding (the scan carries the
    window) gives the single-step tokens, with rows without DRY in the same batch unchanged."""
    chained, single = engines
    prompt = [[7, 8, 9, 10, 11]]
    plain = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    looped = chained.generate(prompt, plain)[0].outputs[0].token_ids
    assert longest_repeat(looped) > 8, looped  # the loop DRY is for
    dry = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, dry_multiplier=0.8, dry_sequence_breakers=[])
    broken = chained.generate(prompt, dry)[0].outputs[0].token_ids
    assert longest_repeat(broken) <= 4, broken  # allowed 2, then each longer repeat costs 0.8 * 1.75^(n - 2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 500, int(rng.integers(1, 30))).tolist() for _ in range(4)]
    batch = [
        dry,
        SamplingParams(temperature=0.8, seed=4, max_tokens=50, ignore_eos=True, dry_multiplier=1.5, dry_base=1.3),
        SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True, repetition_penalty=1.2, dry_multiplier=0.5),
        plain,
    ]
    runs = []
    plan = chained.engine.multi_step.plan
    chained.engine.multi_step.plan = lambda chunks: runs.append(r := plan(chunks)) or r
    got = [o.outputs[0].token_ids for o in chained.generate(prompts, batch)]
    assert got == [o.outputs[0].token_ids for o in single.generate(prompts, batch)]
    assert any(r is not None for r in runs)  # DRY rows ran several steps a dispatch
    assert got[3] == single.generate(prompts[3:], plain)[0].outputs[0].token_ids  # DRY off: unchanged
    chained.engine.pool.check_all_free()


def longest_repeat(tokens: list[int]) -> int:
    """The longest n such that some n tokens occur twice (overlapping allowed)."""
    best = 0
    for i in range(len(tokens)):
        for j in range(i + 1, len(tokens)):
            n = 0
            while j + n < len(tokens) and tokens[i + n] == tokens[j + n]:
                n += 1
            best = max(best, n)
    return best


def test_the_gpus_programs_decide_dry_on_the_host(engines, monkeypatch):
    """On GPUs a lax.cond's predicate is read back to the host (sampling/programs.py): DRY is a program of its own
    there, and a batch without it runs the penalties' program with no DRY branch at all. Run here with the GPU's
    choice of programs: the tokens are the single-step ones either way."""
    import capstan.runtime.engine.multi_step as multi_step
    import capstan.runtime.sampling.programs as programs

    real, chosen = multi_step.scan_branches, []
    monkeypatch.setattr(multi_step, "scan_branches", lambda p, backend: chosen.append(real(p, "gpu")) or chosen[-1])
    chained, single = engines
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 500, int(rng.integers(1, 30))).tolist() for _ in range(3)]
    with_dry = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, dry_multiplier=0.8, dry_sequence_breakers=[]),
        SamplingParams(temperature=0.7, seed=2, max_tokens=36, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    without = [with_dry[1], with_dry[2], SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3)]
    for batch, scans in ((with_dry, programs.DRY_SCANS), (without, programs.PENALTY_SCANS)):
        chosen.clear()
        got = [o.outputs[0].token_ids for o in chained.generate(prompts, batch)]
        assert got == [o.outputs[0].token_ids for o in single.generate(prompts, batch)]
        assert chosen and set(chosen) <= set(scans.values())
    assert all(b.any_dry is False for b in programs.PENALTY_SCANS.values())
    chained.engine.pool.check_all_free()
