"""The on-device sampler's processors on hand-made logits."""

import jax
import jax.numpy as jnp
import numpy as np

from capstan.runtime.sampling.sampler import SamplingBatch
from capstan.runtime.sampling.sampler import sample as sample_eager
from capstan.runtime.scheduling.batch import row_key_data

sample = jax.jit(sample_eager)  # one compile per shape instead of op-by-op dispatch

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


def test_a_grammar_mask_allows_only_its_tokens_and_logprobs_stay_raw():
    allowed = np.array([[0b1100]], np.int32)  # tokens 2 and 3
    b = batch(temperature=np.zeros(1, np.float32), allowed=allowed, any_constrained=np.bool_(True))
    out = sample(jnp.asarray(LOGITS), b)
    assert int(out.tokens[0]) == 2
    assert np.isclose(float(out.logprob[0]), np.log(0.15), atol=1e-5)  # of the model's distribution
    assert draws(batch(allowed=allowed, any_constrained=np.bool_(True))) == {2, 3}
