"""Top-k, top-p and min-p without a sort keep exactly what the sort-based definition keeps, on random logits:
the same kept set, the same renormalised probabilities, and the same seeded samples."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functools

from capstan.runtime.engine.sampler import (filters_by_bisection, filters_by_candidates, filters_by_search, filters_by_sort,
                                           search_passes)
from test_sampler import batch



def sorted_reference(x: np.ndarray, top_k, top_p, min_p, ambiguous: list | None = None) -> np.ndarray:
    """The definition, by a full descending sort (as the sampler did before). `ambiguous` collects the (row, id)
    whose mass above lies within float32 rounding of top_p: summed in another order, either answer is right."""
    out = np.full_like(x, -np.inf)
    for r, row in enumerate(x):
        order = np.argsort(-row, kind="stable")
        ordered = row[order]
        V = len(row)
        k = min(top_k[r], V) if top_k[r] > 0 else V
        kth = ordered[k - 1]
        ordered = np.where(np.arange(V) < k, ordered, -np.inf)
        probs = np.exp(ordered - ordered[0]) / np.sum(np.exp(ordered - ordered[0]))
        before = np.cumsum(probs) - probs
        pth = np.min(np.where(before < top_p[r], ordered, np.inf))
        if ambiguous is not None:
            ambiguous += [(r, i) for i in order[np.abs(before - top_p[r]) < 1e-5]]
        threshold = max(kth, pth)
        if min_p[r] > 0:
            threshold = max(threshold, ordered[0] + np.log(min_p[r]))
        out[r] = np.where(row >= threshold, row, -np.inf)
    return out


@pytest.mark.parametrize("filters", [filters_by_bisection, functools.partial(filters_by_search, pivots=15),
                                     functools.partial(filters_by_search, pivots=6), filters_by_sort,
                                     filters_by_candidates],
                         ids=["bisection", "15-pivot search", "6-pivot search", "sort", "candidates"])
@pytest.mark.parametrize("V, scale", [(64, 1.0), (1000, 3.0), (32_000, 0.5), (32_000, 8.0)])
def test_the_kept_set_is_the_sorted_definitions(V, scale, filters):
    rng = np.random.default_rng(V)
    S = 16
    x = (rng.standard_normal((S, V)) * scale).astype(np.float32)
    x[0, :5] = x[0, 5]  # ties at a boundary
    top_k = rng.choice([0, 1, 5, 50, V - 1, V + 10], S).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.9, 0.5, 0.1, 1e-6], S).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], S).astype(np.float32)
    b = batch(S=S, top_k=top_k, top_p=top_p, min_p=min_p, any_filter=np.bool_(True))
    got = np.asarray(jax.jit(filters)(jnp.asarray(x), b))
    ambiguous = []
    want = sorted_reference(x, top_k, top_p, min_p, ambiguous)
    differ = set(zip(*np.nonzero(np.isfinite(got) != np.isfinite(want))))
    assert differ <= set(ambiguous), differ - set(ambiguous)  # the same kept set, but for float rounding
    rows = [r for r in range(S) if not any(d[0] == r for d in differ)]
    np.testing.assert_allclose(jax.nn.softmax(got[rows], axis=-1), jax.nn.softmax(want[rows], axis=-1),
                               rtol=1e-5, atol=1e-7)


def test_seeded_samples_are_the_same_as_with_the_reference_filters():
    from capstan.runtime.engine import sampler

    rng = np.random.default_rng(9)
    S, V = 32, 4096
    x = (rng.standard_normal((S, V)) * 2).astype(np.float32)
    b = batch(S=S, temperature=np.full(S, 0.8, np.float32), top_k=np.full(S, 40, np.int32),
              top_p=np.full(S, 0.9, np.float32), any_filter=np.bool_(True), want_logprobs=np.bool_(False),
              allowed=np.full((S, V // 32), -1, np.int32))
    ours = np.asarray(jax.jit(sampler.sample)(jnp.asarray(x), b).tokens)
    reference = sorted_reference(x / 0.8, np.full(S, 40), np.full(S, 0.9), np.zeros(S))
    keys = jax.vmap(lambda k, p: jax.random.fold_in(jax.random.wrap_key_data(k), p))(b.key_data, b.position)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    assert ours.tolist() == np.argmax(reference + np.asarray(gumbel), axis=-1).tolist()


def test_the_search_pins_one_key_in_the_passes_it_counts():
    assert [search_passes(p) for p in (1, 3, 15, 255)] == [32, 16, 8, 4]
    assert search_passes(6) == 12  # 7^11 < 2^32 <= 7^12


def peaked(rng, S, V):
    """Zipf-like rows as trained models give: a few tokens hold most of the mass."""
    ranks = np.argsort(rng.random((S, V)), axis=-1) + 1
    return (-2.0 * np.log(ranks) + 0.1 * rng.standard_normal((S, V))).astype(np.float32)


def test_the_16_largest_values_decide_peaked_rows_and_the_fallback_takes_the_rest():
    rng = np.random.default_rng(3)
    S, V = 12, 5000
    no_fallback = lambda x, b: jnp.full_like(x, jnp.nan)  # noqa: E731: marks a batch the candidates did not decide
    top_k = np.array([0, 1, 5, 15, 0, 0, 3, 0, 100, 0, 0, 8], np.int32)
    top_p = np.array([1, 1, 1, 1, 0.9, 0.5, 0.8, 1, 1, 0.7, 1, 0.95], np.float32)
    min_p = np.array([0, 0, 0, 0, 0, 0, 0.1, 0.05, 0.2, 0, 0, 0], np.float32)
    b = batch(S=S, top_k=top_k, top_p=top_p, min_p=min_p, any_filter=np.bool_(True))
    for x, decided in ((peaked(rng, S, V), True), (rng.standard_normal((S, V)).astype(np.float32), False)):
        got = np.asarray(jax.jit(lambda x, b: filters_by_candidates(x, b, no_fallback))(jnp.asarray(x), b))
        assert np.isnan(got).all() != decided
        if decided:
            ambiguous = []
            want = sorted_reference(x, top_k, top_p, min_p, ambiguous)
            differ = set(zip(*np.nonzero(np.isfinite(got) != np.isfinite(want))))
            assert differ <= set(ambiguous)
            filtered = (top_k > 0) | (top_p < 1) | (min_p > 0)
            assert np.isfinite(got[filtered]).sum(-1).max() < 100 and np.isfinite(got[~filtered]).all()
    # one row the candidates cannot decide (top-p over a flat row) sends the whole batch to the fallback
    x = peaked(rng, S, V)
    x[4] = rng.standard_normal(V)
    got = np.asarray(jax.jit(filters_by_candidates)(jnp.asarray(x), b))
    ambiguous = []
    want = sorted_reference(x, top_k, top_p, min_p, ambiguous)
    filtered = (top_k > 0) | (top_p < 1) | (min_p > 0)  # the reference's float cumsum may drop a tail at top_p 1
    differ = set(zip(*np.nonzero(np.isfinite(got) != np.isfinite(want))))
    assert {(r, i) for r, i in differ if filtered[r]} <= set(ambiguous)
    assert np.isfinite(got[4]).sum() > 16 and np.isfinite(got[~filtered]).all()
