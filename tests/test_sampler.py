"""The on-device sampler's processors on hand-made logits."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from capstan.runtime.sampling.programs import GREEDY_SCAN, SAMPLED_SCANS
from capstan.runtime.sampling.sampler import (
    SamplingBatch,
    _apply_penalties,
    count_sampled,
    first_max,
    penalty_counts,
)
from capstan.runtime.sampling.sampler import sample as sample_eager
from capstan.runtime.scheduling.batch import row_key_data

sample = jax.jit(sample_eager, static_argnums=2)  # one compile per shape instead of op-by-op dispatch

V = 8  # the hand-made logits below


def batch(S=1, H=4, **kw):
    fields = dict(
        temperature=np.ones(S, np.float32),
        top_k=np.zeros(S, np.int32),
        top_p=np.ones(S, np.float32),
        min_p=np.zeros(S, np.float32),
        presence_penalty=np.zeros(S, np.float32),
        frequency_penalty=np.zeros(S, np.float32),
        repetition_penalty=np.ones(S, np.float32),
        key_data=np.array([row_key_data(i, 0) for i in range(S)], np.uint32),
        position=np.zeros(S, np.int32),
        bias_ids=np.full((S, 2), V, np.int32),
        bias_values=np.zeros((S, 2), np.float32),
        banned_ids=np.full((S, 2), V, np.int32),
        history=np.full((S, H), V, np.int32),
        prompt_lens=np.zeros(S, np.int32),
        allowed=np.full((S, 1), -1, np.int32),
        any_constrained=np.bool_(False),
        any_penalty=np.bool_(False),
        any_filter=np.bool_(False),
        want_logprobs=np.bool_(True),
        plain_greedy=np.bool_(False),
    )
    fields.update(kw)
    return SamplingBatch(**fields)


LOGITS = np.log(np.array([[0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9, 1e-9, 1e-9]], np.float32))


def draws(b, n=200, logits=LOGITS):
    """Tokens drawn with n different keys."""
    keys = np.array([row_key_data(i, 0) for i in range(n)], np.uint32)
    wide = {k: np.repeat(v, n, axis=0) if np.ndim(v) else v for k, v in b.__dict__.items()}
    wide["key_data"] = keys
    return set(np.asarray(sample(jnp.asarray(np.repeat(logits, n, axis=0)), SamplingBatch(**wide)).tokens).tolist())


def test_greedy_takes_the_argmax_and_reports_raw_logprobs():
    r = sample(jnp.asarray(LOGITS), batch(temperature=np.zeros(1, np.float32)))
    assert int(r.tokens[0]) == 0 and int(r.rank[0]) == 1
    np.testing.assert_allclose(float(r.logprob[0]), np.log(0.5), atol=1e-5)
    assert list(np.asarray(r.top_ids[0, :3])) == [0, 1, 2]


def test_top_k_top_p_min_p_restrict_the_support():
    assert draws(batch()) >= {0, 1, 2}
    assert draws(batch(top_k=np.array([2], np.int32), any_filter=np.bool_(True))) == {0, 1}
    assert draws(batch(top_p=np.array([0.6], np.float32), any_filter=np.bool_(True))) == {0, 1}
    assert draws(batch(min_p=np.array([0.5], np.float32), any_filter=np.bool_(True))) == {0, 1}
    assert draws(batch(top_k=np.array([1], np.int32), any_filter=np.bool_(True))) == {0}


def test_logit_bias_and_bans():
    b = batch(
        temperature=np.zeros(1, np.float32),
        bias_ids=np.array([[3, V]], np.int32),
        bias_values=np.array([[100.0, 0]], np.float32),
    )
    assert int(sample(jnp.asarray(LOGITS), b).tokens[0]) == 3
    b = batch(temperature=np.zeros(1, np.float32), banned_ids=np.array([[0, 1]], np.int32))
    assert int(sample(jnp.asarray(LOGITS), b).tokens[0]) == 2


def test_penalties_count_output_tokens_and_repetition_covers_the_prompt():
    greedy = np.zeros(1, np.float32)
    history = np.array([[1, 0, 0, V]], np.int32)  # prompt [1], output [0, 0]
    b = batch(
        temperature=greedy,
        history=history,
        prompt_lens=np.array([1], np.int32),
        any_penalty=np.bool_(True),
        frequency_penalty=np.array([0.3], np.float32),
    )
    assert int(sample(jnp.asarray(LOGITS), b).tokens[0]) == 1  # two outputs of 0 cost it 0.6: log .5 - .6 < log .3
    b = batch(
        temperature=greedy,
        history=history,
        prompt_lens=np.array([1], np.int32),
        any_penalty=np.bool_(True),
        presence_penalty=np.array([0.6], np.float32),
    )
    assert int(sample(jnp.asarray(LOGITS), b).tokens[0]) == 1
    b = batch(
        temperature=greedy,
        history=np.array([[0, V, V, V]], np.int32),
        prompt_lens=np.array([1], np.int32),
        any_penalty=np.bool_(True),
        repetition_penalty=np.array([2.0], np.float32),
    )
    assert int(sample(jnp.asarray(LOGITS), b).tokens[0]) == 1  # prompt token 0's negative logit doubled


def reference_penalties(logits, history, prompt_lens, rep, freq, pres, stop_ids) -> np.ndarray:
    """The penalties row by row on the CPU, as vLLM defines them, except that the repetition penalty leaves the
    row's stop tokens alone."""
    out = np.array(logits, np.float64)
    for r in range(out.shape[0]):
        tokens = [int(t) for t in history[r] if t < out.shape[1]]
        prompt, output = tokens[: prompt_lens[r]], tokens[prompt_lens[r] :]
        for t in set(prompt + output) - {int(s) for s in stop_ids[r]}:
            out[r, t] = out[r, t] / rep[r] if out[r, t] > 0 else out[r, t] * rep[r]
        for t in set(output):
            out[r, t] -= freq[r] * output.count(t) + pres[r]
    return out


def penalised_batch(seed: int, S: int = 4, W: int = 32, H: int = 12):
    """Rows of random histories with penalties, each with stop ids that occur in its prompt and (row 1) not at
    all; row 3 has none (ignore_eos without stop_token_ids)."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(2, 8, S).astype(np.int32)
    history = np.full((S, H), W, np.int32)
    stop_ids = np.full((S, 3), W, np.int32)
    for r in range(S):
        n = int(prompt_lens[r]) + int(rng.integers(0, H - prompt_lens[r] + 1))
        history[r, :n] = rng.integers(0, 8, n)  # few ids: repeats in the prompt and the output
        if r != 3:
            stop_ids[r, :2] = [history[r, 0], 30 if r == 1 else history[r, 1]]
    logits = rng.normal(0.0, 2.0, (S, W)).astype(np.float32)
    fields = dict(
        temperature=np.zeros(S, np.float32),
        history=history,
        prompt_lens=prompt_lens,
        any_penalty=np.bool_(True),
        repetition_penalty=rng.uniform(1.0, 2.0, S).astype(np.float32),
        frequency_penalty=rng.uniform(-0.5, 0.5, S).astype(np.float32),
        presence_penalty=rng.uniform(-0.5, 0.5, S).astype(np.float32),
        stop_ids=stop_ids,
    )
    return logits, batch(S=S, H=H, **fields)


def test_the_penalties_with_stop_tokens_exempt_agree_with_a_cpu_reference():
    apply = jax.jit(_apply_penalties)
    for seed in range(5):
        logits, b = penalised_batch(seed)
        expected = reference_penalties(
            logits, b.history, b.prompt_lens, b.repetition_penalty, b.frequency_penalty, b.presence_penalty, b.stop_ids
        )
        np.testing.assert_allclose(np.asarray(apply(jnp.asarray(logits), b)), expected, rtol=1e-5, atol=1e-5)
        # a multi-step decode carries counts instead of reading the history: the last token counted on top of
        # the rest reads the same
        last = np.maximum(b.prompt_lens, (b.history < logits.shape[1]).sum(axis=1) - 1)
        rows = np.arange(logits.shape[0])
        shorter = b.history.copy()
        shorter[rows, last] = logits.shape[1]
        before = eqx.tree_at(lambda s: s.history, b, shorter)
        with_output = last >= b.prompt_lens  # rows whose last history token is an output token
        counts = penalty_counts(jax.tree.map(jnp.asarray, before), logits.shape[1])
        counts = count_sampled(counts, jnp.asarray(np.where(with_output, b.history[rows, last], logits.shape[1])))
        carried = np.asarray(apply(jnp.asarray(logits), b, counts))
        np.testing.assert_allclose(carried[with_output], expected[with_output], rtol=1e-5, atol=1e-5)


def test_the_repetition_penalty_leaves_the_rows_stop_tokens_in_the_prompt_alone():
    """The chat template ends every message of the prompt with its end-of-turn token: penalising it as a repeat
    would hold back the end of every answer (issue 67). An ordinary prompt token is still penalised."""
    penalised = dict(
        temperature=np.zeros(1, np.float32),
        history=np.array([[0, 1, V, V]], np.int32),  # the prompt holds tokens 0 and 1
        prompt_lens=np.array([2], np.int32),
        any_penalty=np.bool_(True),
        repetition_penalty=np.array([3.0], np.float32),
    )
    logits = jnp.asarray(LOGITS)
    stop_0 = np.array([[0, V]], np.int32)  # token 0 ends the row
    x = np.asarray(jax.jit(_apply_penalties)(logits, batch(**penalised, stop_ids=stop_0)))
    assert x[0, 0] == LOGITS[0, 0]  # the stop token: untouched
    np.testing.assert_allclose(x[0, 1], 3 * LOGITS[0, 1], rtol=1e-6)  # the ordinary prompt token: penalised
    np.testing.assert_array_equal(x[0, 2:], LOGITS[0, 2:])  # tokens not in the prompt: untouched
    assert int(sample(logits, batch(**penalised)).tokens[0]) == 2  # 0 and 1 penalised: log .15 > 3 log .5
    assert int(sample(logits, batch(**penalised, stop_ids=stop_0)).tokens[0]) == 0  # not a repeat: it ends the row


def test_a_rows_draw_depends_on_its_key_and_position_not_its_batch():
    logits = np.tile(np.log(np.full((1, V), 1.0 / V, np.float32)), (4, 1))
    keys = np.array([row_key_data(7, 0)] + [row_key_data(i, 1) for i in range(3)], np.uint32)
    together = sample(jnp.asarray(logits), batch(S=4, key_data=keys, position=np.full(4, 9, np.int32)))
    alone = sample(jnp.asarray(logits[:1]), batch(S=1, key_data=keys[:1], position=np.full(1, 9, np.int32)))
    assert int(together.tokens[0]) == int(alone.tokens[0])


def test_plain_greedy_fast_path_matches_the_processed_path():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(4, V)).astype(np.float32) * 3)
    keys = np.array([row_key_data(i, 0) for i in range(4)], np.uint32)
    slow = sample(logits, batch(S=4, temperature=np.zeros(4, np.float32), key_data=keys))
    fast = sample(logits, batch(S=4, temperature=np.zeros(4, np.float32), key_data=keys, plain_greedy=np.bool_(True)))
    assert np.asarray(fast.tokens).tolist() == np.asarray(jnp.argmax(logits, -1)).tolist()
    for a, b in zip(jax.tree_util.tree_leaves(slow), jax.tree_util.tree_leaves(fast), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_host_decided_branches_without_logprobs_leave_out_the_normaliser():
    """The decode scans' greedy and sampled programs: the same tokens, and no exp over the logits (logsumexp's) where
    the host knows no row asked for logprobs (the chosen tokens' logprob is then 0 and never read)."""
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(4, V)).astype(np.float32) * 3)
    keys = np.array([row_key_data(i, 0) for i in range(4)], np.uint32)
    for branches in (GREEDY_SCAN, SAMPLED_SCANS[False]):
        greedy = branches.all_greedy
        b = batch(
            S=4,
            temperature=np.full(4, 0.0 if greedy else 0.7, np.float32),
            top_p=np.full(4, 0.9, np.float32),
            key_data=keys,
            plain_greedy=np.bool_(greedy),
            any_filter=np.bool_(not greedy),
            want_logprobs=np.bool_(False),
        )
        with_lp = branches._replace(want_logprobs=True)
        want, got = sample(logits, b, with_lp), sample(logits, b, branches)
        assert np.asarray(got.tokens).tolist() == np.asarray(want.tokens).tolist()
        assert np.asarray(got.logprob).tolist() == [0.0] * 4
        assert "exp" in str(jax.make_jaxpr(sample_eager, static_argnums=2)(logits, b, with_lp))
        if greedy:  # the sampled draw has exps of its own (the candidates' masses); the greedy program none
            assert "exp" not in str(jax.make_jaxpr(sample_eager, static_argnums=2)(logits, b, branches))


def test_a_grammar_mask_allows_only_its_tokens_and_logprobs_stay_raw():
    allowed = np.array([[0b1100]], np.int32)  # tokens 2 and 3
    b = batch(temperature=np.zeros(1, np.float32), allowed=allowed, any_constrained=np.bool_(True))
    out = sample(jnp.asarray(LOGITS), b)
    assert int(out.tokens[0]) == 2
    assert np.isclose(float(out.logprob[0]), np.log(0.15), atol=1e-5)  # of the model's distribution
    assert draws(batch(allowed=allowed, any_constrained=np.bool_(True))) == {2, 3}


def test_first_max_is_argmax_with_ties_nans_and_infinities():
    """The sampler's argmax by plain reductions (first_max) against jnp.argmax, row by row: ties take the first,
    a NaN wins over everything (the first NaN), +inf over finite values, an all -inf row gives 0."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 1000)).astype(np.float32)
    x[1, [10, 20]] = 5.0  # a tie
    x[2, [30, 40]] = np.nan
    x[3, [50, 60]] = np.inf
    x[4, 70], x[4, 80] = np.inf, np.nan  # NaN after +inf still wins
    x[5] = -np.inf
    x[6, 999] = 9.0  # the last id
    x[7] = np.round(x[7])  # many ties
    x[8, 0] = np.nan
    got = np.asarray(jax.jit(first_max)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    if jax.default_backend() == "cpu":  # elsewhere first_max is XLA's argmax, which on an H100 took the second NaN
        assert list(got[1:7]) == [10, 30, 50, 80, 0, 999]
