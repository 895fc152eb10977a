"""Top-k, top-p and min-p without a sort keep exactly what the sort-based definition keeps, on random logits:
the same kept set, the same renormalised probabilities, and the same seeded samples (the candidates' draw:
the same tokens as the definition's kept set with the same Gumbel noise)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampler import batch

from capstan.runtime.sampling.sampler import (
    BLOCK,
    BLOCKS,
    KEPT,
    RowNoise,
    _draw,
    _draw_kept,
    best_by_blocks,
    best_by_top_k,
    block_maxima,
    draw_by_candidates,
    draw_by_kernels,
    draw_by_top,
    filters_by_bisection,
    filters_by_search,
    filters_by_sort,
    filters_by_top,
    gumbel_at,
    gumbel_row,
    mass_above,
    row_keys,
    search_passes,
    top_candidates,
    top_thresholds,
)


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
        pth = np.min(np.where(before < top_p[r], ordered, np.inf)) if top_p[r] < 1 else -np.inf  # 1: off
        if ambiguous is not None and top_p[r] < 1:  # among the top-k only: the rest are out either way
            ambiguous += [(r, i) for i in order[:k][np.abs(before[:k] - top_p[r]) < 1e-5]]
        threshold = max(kth, pth)
        if min_p[r] > 0:
            threshold = max(threshold, ordered[0] + np.log(min_p[r]))
        out[r] = np.where(row >= threshold, row, -np.inf)
    return out


@pytest.mark.parametrize(
    "filters",
    [
        filters_by_bisection,
        functools.partial(filters_by_search, pivots=15),
        functools.partial(filters_by_search, pivots=6),
        filters_by_sort,
        filters_by_top,
    ],
    ids=["bisection", "15-pivot search", "6-pivot search", "sort", "top"],
)
@pytest.mark.parametrize("V, scale", [(64, 1.0), (1000, 3.0), (32_000, 0.5), (32_000, 8.0), (32_000, "peaked")])
def test_the_kept_set_is_the_sorted_definitions(V, scale, filters):
    rng = np.random.default_rng(V)
    S = 16
    if scale == "peaked":  # rows whose top 64 values decide every filter: filters_by_top's own way, not its fallback
        x = peaked(rng, S, V)
        top_k = rng.choice([0, 1, 5, 50, V + 10], S).astype(np.int32)
        assert np.asarray(top_thresholds(jnp.asarray(x), batch(S=S, top_k=top_k, top_p=np.full(S, 0.9, np.float32),
                                                                any_filter=np.bool_(True)))[1]).all()  # fmt: skip
    else:
        x = (rng.standard_normal((S, V)) * scale).astype(np.float32)
        top_k = rng.choice([0, 1, 5, 50, V - 1, V + 10], S).astype(np.int32)
    x[0, :5] = x[0, 5]  # ties at a boundary
    top_p = rng.choice([1.0, 0.95, 0.9, 0.5, 0.1, 1e-6], S).astype(np.float32)
    if scale == "peaked":
        top_p = np.minimum(top_p, 0.9)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], S).astype(np.float32)
    b = batch(S=S, top_k=top_k, top_p=top_p, min_p=min_p, any_filter=np.bool_(True))
    got = np.asarray(jax.jit(filters)(jnp.asarray(x), b))
    ambiguous = []
    want = sorted_reference(x, top_k, top_p, min_p, ambiguous)
    differ = set(zip(*np.nonzero(np.isfinite(got) != np.isfinite(want)), strict=True))
    assert differ <= set(ambiguous), differ - set(ambiguous)  # the same kept set, but for float rounding
    rows = [r for r in range(S) if not any(d[0] == r for d in differ)]
    np.testing.assert_allclose(
        jax.nn.softmax(got[rows], axis=-1), jax.nn.softmax(want[rows], axis=-1), rtol=1e-5, atol=1e-7
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's lowering (a GPU's HLO has no TopK op)")
def test_the_cpu_filters_top_k_stays_a_top_k():
    """XLA:CPU compiles a top-k whose values feed several fusions as a full sort of the row (60x slower at 16 x
    49,152); filters_by_top gathers its values by id so that its top-k stays XLA's TopK (structure, not timing)."""
    S, V = 4, 49152
    x = jnp.zeros((S, V), jnp.float32)
    b = batch(S=S, top_p=np.full(S, 0.9, np.float32), any_filter=np.bool_(True))
    hlo = jax.jit(filters_by_top).lower(x, b).compile().as_text()
    assert "TopK" in hlo
    assert not [line for line in hlo.splitlines() if f"f32[{S},{V}]" in line and " sort(" in line]


def test_seeded_samples_are_the_same_as_with_the_reference_filters():
    from capstan.runtime.sampling import sampler

    rng = np.random.default_rng(9)
    S, V = 32, 4096
    x = (rng.standard_normal((S, V)) * 2).astype(np.float32)
    b = batch(
        S=S,
        temperature=np.full(S, 0.8, np.float32),
        top_k=np.full(S, 40, np.int32),
        top_p=np.full(S, 0.9, np.float32),
        any_filter=np.bool_(True),
        want_logprobs=np.bool_(False),
        allowed=np.full((S, V // 32), -1, np.int32),
    )
    ours = np.asarray(jax.jit(sampler.sample)(jnp.asarray(x), b).tokens)
    reference = sorted_reference(x / 0.8, np.full(S, 40), np.full(S, 0.9), np.zeros(S))
    keys = jax.vmap(lambda k, p: jax.random.fold_in(jax.random.wrap_key_data(k), p))(b.key_data, b.position)
    with jax.threefry_partitionable(False):
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    assert ours.tolist() == np.argmax(reference + np.asarray(gumbel), axis=-1).tolist()


def test_the_search_pins_one_key_in_the_passes_it_counts():
    assert [search_passes(p) for p in (1, 3, 15, 255)] == [32, 16, 8, 4]
    assert search_passes(6) == 12  # 7^11 < 2^32 <= 7^12


def peaked(rng, S, V):
    """Zipf-like rows as trained models give: a few tokens hold most of the mass."""
    ranks = np.argsort(rng.random((S, V)), axis=-1) + 1
    return (-2.0 * np.log(ranks) + 0.1 * rng.standard_normal((S, V))).astype(np.float32)


def candidates_draw(x, b, fallback=None, best=best_by_top_k, in_one_pass=False, kernels=False):
    """draw_by_candidates (or with kernels, draw_by_kernels: the noise its own threefry) on x with the row keys'
    Gumbel noise (jax.random.gumbel over the row), and that noise."""
    V = x.shape[1]
    keys = jax.vmap(lambda k, p: jax.random.fold_in(jax.random.wrap_key_data(k), p))(b.key_data, b.position)
    with jax.threefry_partitionable(False):
        noise = jax.jit(lambda k: jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(k))(keys)
    greedy = jnp.asarray(b.temperature == 0)
    at = lambda ids=None: noise if ids is None else jnp.take_along_axis(noise, ids, axis=-1)  # noqa: E731
    if kernels:
        draw = lambda x, b: draw_by_kernels(x, b, greedy, RowNoise(row_keys(b), V), fallback)  # noqa: E731
    else:
        draw = lambda x, b: draw_by_candidates(x, b, greedy, at, fallback, best, in_one_pass)  # noqa: E731
    return np.asarray(jax.jit(draw)(jnp.asarray(x), b)), np.asarray(noise)


@pytest.mark.parametrize("V", [5000, 4999])
def test_the_noise_of_one_id_is_the_full_rows_noise_at_it(V):
    """JAX's Gumbel draw of a whole row, in its original threefry layout (ids i and i + V/2 one call's two words;
    an odd row padded), is the noise of each id drawn alone, and of the whole row drawn in pairs."""
    keys = jax.vmap(lambda p: jax.random.fold_in(jax.random.key(7), p))(jnp.arange(3))
    with jax.threefry_partitionable(False):
        full = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (3, 40)))
    data = jax.random.key_data(keys)
    np.testing.assert_array_equal(gumbel_at(data, jnp.arange(V)[None, :], V), full)
    np.testing.assert_array_equal(gumbel_row(data, V), full)
    np.testing.assert_array_equal(gumbel_at(data, ids, V), jnp.take_along_axis(full, ids, axis=-1))


@pytest.mark.parametrize("kept", ["few", "many"])
def test_a_draw_over_the_kept_tokens_ids_gives_the_whole_rows_tokens(kept):
    """_draw_kept (the CPU's draw after the filters) against _draw (noise over the whole row), over many keys: rows
    that keep a few tokens (noise at their ids only), and a batch where one sampled row keeps more than KEPT (the
    whole row's noise for all); greedy rows keep everything and take the argmax either way."""
    rng = np.random.default_rng(11)
    S, V = 12, 3000
    x = peaked(rng, S, V)
    top_p = np.full(S, 0.9 if kept == "few" else 0.999999, np.float32)
    temperature = np.where(np.arange(S) % 4 == 0, 0.0, 0.7).astype(np.float32)
    same = 0
    for seed in range(8):
        b = batch(S=S, temperature=temperature, top_p=top_p, any_filter=np.bool_(True),
                  position=np.arange(S, dtype=np.int32) + 100 * seed)  # fmt: skip
        filtered = filters_by_bisection(jnp.asarray(x / temperature.clip(0.1)[:, None]), b)
        greedy = jnp.asarray(temperature == 0)
        kept_counts = np.asarray(jnp.sum(filtered > -jnp.inf, axis=-1))[temperature > 0]
        assert (kept_counts.max() <= KEPT) == (kept == "few")
        keys = row_keys(b)
        got = jax.jit(lambda f, g, k: _draw_kept(f, g, RowNoise(k, V)))(filtered, greedy, keys)
        want = _draw(filtered, greedy, RowNoise(keys, V))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        same += int((np.asarray(got)[temperature > 0] != np.argmax(x, axis=-1)[temperature > 0]).any())
    assert same > 0  # the draws did sample: some row left its argmax


@pytest.mark.parametrize("rows", ["peaked", "past", "flat", "ties"])
def test_the_top_draw_gives_the_tokens_of_the_top_filters_then_the_kept_draw(rows):
    """draw_by_top (the CPU's sampler: its candidates perturbed where they hold every kept token) against
    _draw_kept(filters_by_top(...)), the two steps it replaces, over many keys: peaked rows (their 64 largest decide
    and hold every kept set: the candidates' draw), a batch with a top-k past the 64, flat rows (the bisection's
    fallback), and rows whose threshold value is tied past the 64 (the whole filtered row's draw)."""
    rng = np.random.default_rng(5)
    S, V = 16, 3000
    x = peaked(rng, S, V) if rows != "flat" else (rng.standard_normal((S, V)) * 1.5).astype(np.float32)
    temperature = np.where(np.arange(S) % 5 == 0, 0.0, 0.8).astype(np.float32)
    top_k = np.where(np.arange(S) % 3 == 1, 50, 0).astype(np.int32)
    min_p = np.where(np.arange(S) % 4 == 2, 0.05, 0.0).astype(np.float32)
    top_p = np.full(S, 0.9, np.float32)
    if rows == "past":
        top_k[S - 1] = 100  # a row whose top-k reaches past the 64: the filtered row's draw for all
    if rows == "ties":
        x[:, :] = np.minimum(x, np.sort(x, axis=-1)[:, -60:-59])  # the 60th largest on, all equal: 2,941 ties
        top_k[:], top_p[:] = 64, 1.0  # decided by the 64, but the 64th value's ties past them are kept too
    drawn = set()
    for seed in range(8):
        b = batch(S=S, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, any_filter=np.bool_(True),
                  position=np.arange(S, dtype=np.int32) + 100 * seed)  # fmt: skip
        scaled = jnp.asarray(x / temperature.clip(0.1)[:, None])
        greedy = jnp.asarray(temperature == 0)
        threshold, decided, _, values = top_candidates(scaled, b)
        fast = bool(jnp.all(decided & ((values[:, -1] < threshold) | greedy)))
        assert fast == (rows == "peaked"), rows  # which way each case takes
        keys = row_keys(b)
        got = jax.jit(lambda x, b, g, k: draw_by_top(x, b, g, RowNoise(k, V)))(scaled, b, greedy, keys)
        want = jax.jit(lambda x, b, g, k: _draw_kept(filters_by_top(x, b), g, RowNoise(k, V)))(scaled, b, greedy, keys)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        drawn |= set(np.asarray(got)[temperature > 0].tolist())
    assert len(drawn) > S  # the draws did sample


def reference_draw(x, noise, top_k, top_p, min_p, greedy):
    ambiguous = []
    kept = sorted_reference(x, top_k, top_p, min_p, ambiguous)
    return np.where(greedy, np.argmax(x, axis=-1), np.argmax(kept + noise, axis=-1)), ambiguous


V_LARGE = 2 * BLOCK * BLOCKS + 123  # more blocks than candidates, and a ragged last block
V_EVEN = V_LARGE + 1  # an even row: the kernels' `drawn` perturbs each id with its pair partner's threefry call


@pytest.mark.parametrize(
    "best, in_one_pass, kernels",
    [(best_by_top_k, False, False), (best_by_blocks, False, False), (best_by_blocks, True, False), (None, False, True)],
    ids=["top-k", "blocks", "blocks-one-pass", "kernels"],
)
@pytest.mark.parametrize("rows", ["flat", "peaked", "mixed"])
def test_the_candidates_draw_gives_the_tokens_of_the_sorted_definition(rows, best, in_one_pass, kernels):
    rng = np.random.default_rng(len(rows))
    S, V = 24, V_LARGE
    x = peaked(rng, S, V) if rows == "peaked" else (rng.standard_normal((S, V)) * 1.5).astype(np.float32)
    if rows == "mixed":
        x[::2] = peaked(rng, S // 2, V)
    x[0, :300] = x[0, 300]  # ties across the candidates' edge
    top_k = rng.choice([0, 0, 1, 5, 50, BLOCKS, V + 10], S).astype(np.int32)  # k beyond: the fallback test
    top_p = rng.choice([1.0, 0.95, 0.9, 0.5, 0.1, 1e-6], S).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], S).astype(np.float32)
    temperature = rng.choice([0.0, 1.0, 1.0, 1.0], S).astype(np.float32)
    b = batch(
        S=S,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        any_filter=np.bool_(True),
        position=np.arange(S, dtype=np.int32),
    )
    got, noise = candidates_draw(x, b, best=best, in_one_pass=in_one_pass, kernels=kernels)
    want, ambiguous = reference_draw(x, noise, top_k, top_p, min_p, temperature == 0)
    unsure = set(ambiguous)  # tokens whose mass above is within float rounding of top_p: either answer is right
    assert [r for r in range(S) if got[r] != want[r] and not {(r, got[r]), (r, want[r])} & unsure] == []
    assert (got == want).mean() > 0.8


@pytest.mark.parametrize("V", [V_LARGE, V_EVEN])
@pytest.mark.parametrize("kernels", [False, True], ids=["xla", "kernels"])
def test_candidates_decide_peaked_rows_and_flat_top_p_rows_without_the_fallback(kernels, V):
    rng = np.random.default_rng(4)
    S = 16
    only_last = lambda x, b: jnp.where(jnp.arange(x.shape[1]) == x.shape[1] - 1, 0.0, -jnp.inf)  # noqa: E731
    top_k = np.array([0, 1, 50, 0, 0, 3, 0, 100, 0, BLOCKS, 40, 0, 0, 0, 0, 0], np.int32)
    top_p = np.array([1, 1, 1, 0.9, 0.5, 0.8, 1, 1, 0.7, 1, 0.95, 0.95, 0.9, 1, 1, 0.99], np.float32)
    min_p = np.array([0, 0, 0.05, 0, 0, 0.1, 0.05, 0.2, 0, 0, 0, 0, 0, 0, 0, 0], np.float32)
    b = batch(S=S, top_k=top_k, top_p=top_p, min_p=min_p, any_filter=np.bool_(True))
    for x in (peaked(rng, S, V), rng.standard_normal((S, V)).astype(np.float32)):  # trained-like, then flat
        got, noise = candidates_draw(x, b, fallback=only_last, kernels=kernels)
        want, ambiguous = reference_draw(x, noise, top_k, top_p, min_p, np.zeros(S, bool))
        assert (got != V - 1).all() and (got == want).all()
    # a flat row whose top-k (beyond the candidates) is open sends the whole batch to the fallback
    x = peaked(rng, S, V)
    x[0] = rng.standard_normal(V)
    b = batch(
        S=S,
        top_k=np.where(np.arange(S) == 0, 3000, top_k).astype(np.int32),
        top_p=top_p,
        min_p=min_p,
        any_filter=np.bool_(True),
    )
    assert (candidates_draw(x, b, fallback=only_last, kernels=kernels)[0] == V - 1).all()
    got, noise = candidates_draw(x, b, kernels=kernels)
    assert got.tolist() == reference_draw(x, noise, np.asarray(b.top_k), top_p, min_p, np.zeros(S, bool))[0].tolist()


def test_the_exact_kernel_draws_the_rows_the_candidates_leave_open():
    rng = np.random.default_rng(5)
    S, V = 16, V_LARGE
    x = rng.standard_normal((S, V)).astype(np.float32)  # flat: top-k cuts most of the mass
    x[-1] = 1.5  # a greedy row tied across every block: its argmax is not among the candidates' decisions
    top_k = np.array([300, 1000, 5000, 300, 1000, 5000, 700, 2000] * 2, np.int32)  # beyond the candidates
    top_p = np.array([1, 1, 1, 0.9, 0.5, 0.3, 1, 0.8] * 2, np.float32)
    min_p = np.array([0] * 8 + [0.01, 0, 0.05, 0, 0.02, 0, 0, 0.1], np.float32)
    temperature = np.where(np.arange(S) == S - 1, 0.0, 1.0).astype(np.float32)
    b = batch(
        S=S,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        any_filter=np.bool_(True),
        position=np.arange(S, dtype=np.int32),
    )
    only_last = lambda x, b: jnp.where(jnp.arange(x.shape[1]) == x.shape[1] - 1, 0.0, -jnp.inf)  # noqa: E731
    assert (candidates_draw(x, b, fallback=only_last, kernels=True)[0][:-1] == V - 1).all()  # left open
    got, noise = candidates_draw(x, b, kernels=True)
    want, ambiguous = reference_draw(x, noise, top_k, top_p, min_p, temperature == 0)
    unsure = set(ambiguous)
    assert got[-1] == 0
    assert [r for r in range(S) if got[r] != want[r] and not {(r, got[r]), (r, want[r])} & unsure] == []


@pytest.mark.parametrize("V", [V_LARGE, V_EVEN])
def test_the_kernels_scaling_as_they_load_give_the_scaled_logits_tokens(V):
    """Issue 64: the kernels reading the raw logits and dividing by each row's temperature as they load (no scaled
    copy) draw what they draw from the scaled copy, in every stage: peaked rows decided among the candidates, flat
    top-p rows through `drawn` and the mass test, top-k beyond the candidates through `exact`, greedy rows (t 1)."""
    from capstan.runtime.kernels.gpu_sampler import draw

    rng = np.random.default_rng(11)
    S = 16
    x = (rng.standard_normal((S, V)) * 1.5).astype(np.float32)
    x[::3] = peaked(rng, len(x[::3]), V)
    top_k = np.array([0, 50, 0, 0, 3000, 0, 1, 0] * 2, np.int32)
    top_p = np.array([0.9, 1, 0.95, 0.5, 1, 0.8, 1, 1] * 2, np.float32)
    min_p = np.array([0, 0.05, 0, 0, 0, 0, 0, 0.1] * 2, np.float32)
    t = np.array([0.7, 1.3, 0.8, 1.0, 1.7, 2.0, 0.3, 1.0] * 2, np.float32)  # 1.0 at greedy rows, as the sampler's t
    greedy = np.arange(S) % 8 == 3
    keys = rng.integers(0, 2**32, (S, 2), dtype=np.uint32)
    scaled = jnp.asarray(x) / jnp.asarray(t)[:, None]

    def tokens(x, temperature):
        return np.asarray(
            jax.jit(draw, static_argnames=("exact", "interpret"))(
                x, block_maxima(scaled), top_k, top_p, min_p, jnp.asarray(greedy), keys,
                interpret=jax.default_backend() != "gpu", temperature=temperature,
            )[0]
        )  # fmt: skip

    want = tokens(scaled, None)
    assert tokens(jnp.asarray(x), jnp.asarray(t)).tolist() == want.tolist()
    assert (want[greedy] == np.argmax(x[greedy], axis=-1)).all()
    assert tokens(jnp.asarray(x), None).tolist() != want.tolist()  # the temperature matters to these rows


@pytest.mark.parametrize("V", [V_LARGE, 4096, 1000])  # a ragged end, whole chunks, a row shorter than a chunk
def test_the_one_pass_mass_kernel_gives_each_values_mass_above(V):
    from capstan.runtime.kernels.gpu_mass_above import mass_above as one_pass

    rng = np.random.default_rng(V)
    S, D = 6, 16
    x = (rng.standard_normal((S, V)) * 2).astype(np.float32)
    x[0, :50] = x[0, 50]  # ties with a drawn value
    x[1, -7:] = -np.inf  # tokens a grammar or ban removed
    cut = np.where(np.arange(S) % 2 == 0, -np.inf, np.sort(x, axis=1)[:, -40]).astype(np.float32)  # top-k on odd rows
    top = x.max(axis=1)
    values = np.take_along_axis(x, rng.integers(0, V, (S, D)), axis=1)
    weights = jnp.where(x >= cut[:, None], jnp.exp(x - top[:, None]), 0.0)
    want = mass_above(jnp.asarray(x), weights, jnp.asarray(values))
    got = one_pass(
        jnp.asarray(x),
        jnp.asarray(cut),
        jnp.asarray(top),
        jnp.asarray(values),
        interpret=jax.default_backend() != "gpu",
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6)


def test_the_kernels_threefry_is_jaxs():
    from capstan.runtime.kernels.gpu_sampler import gumbel

    keys = jax.random.key_data(jax.vmap(lambda p: jax.random.fold_in(jax.random.key(11), p))(jnp.arange(4)))
    for V in (3000, 2999):
        ids = jnp.arange(V)
        want = gumbel_at(keys, ids[None, :], V)
        got = jax.jit(jax.vmap(lambda k: gumbel(k[0], k[1], ids, V)))(keys)  # noqa: B023
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("how", ["scaled", "raw", "load"])
def test_the_kernels_block_maxima_before_the_bias_give_the_same_tokens(how, monkeypatch):
    """Issue 64: with the branches decided on the host, the kernels' block maxima are taken as the temperature
    scales the logits, before the bias and bans (the blocks they touch taken again): the same tokens as maxima of
    the final logits, with a bias lowering a block's maximum, one raising a token above every other, and bans."""
    from capstan.runtime.sampling.sampler import Branches, refresh_maxima, sample

    rng = np.random.default_rng(7)
    S, V = 12, V_LARGE
    x = (rng.standard_normal((S, V)) * 2.0).astype(np.float32)
    x[1::3] = peaked(rng, len(x[1::3]), V)
    top = np.argmax(x, axis=-1)
    bias_ids = np.full((S, 2), V, np.int32)
    bias_values = np.zeros((S, 2), np.float32)
    bias_ids[0::2, 0], bias_values[0::2, 0] = top[0::2], -100.0  # the row's best block loses its maximum
    bias_ids[1::4, 1], bias_values[1::4, 1] = 5, 60.0  # token 5 above every other
    banned_ids = np.full((S, 2), V, np.int32)
    banned_ids[3::4, 0] = top[3::4]
    kind = np.arange(S) % 3
    b = batch(
        S=S,
        temperature=np.where(kind == 0, 0.0, np.where(kind == 1, 0.7, 1.3)).astype(np.float32),
        top_k=np.where(kind == 2, 50, 0).astype(np.int32),
        top_p=np.where(kind == 1, 0.9, 1.0).astype(np.float32),
        min_p=np.where(kind == 2, 0.05, 0.0).astype(np.float32),
        bias_ids=bias_ids,
        bias_values=bias_values,
        banned_ids=banned_ids,
        any_filter=np.bool_(True),
        want_logprobs=np.bool_(False),
        position=np.arange(S, dtype=np.int32),
    )
    branches = Branches(
        plain_greedy=False, any_constrained=False, any_penalty=False, any_filter=True, all_greedy=False,
        want_logprobs=False,
    )  # fmt: skip
    monkeypatch.setenv("CAPSTAN_SAMPLING_FILTERS", "kernels")
    tokens = {}
    for way in (how, ""):
        monkeypatch.setenv("CAPSTAN_SAMPLER_PREMAXIMA", way)
        tokens[way] = np.asarray(jax.jit(functools.partial(sample, branches=branches))(jnp.asarray(x), b).tokens)
    assert tokens[how].tolist() == tokens[""].tolist()
    assert (tokens[how][1::4] == 5).all() and (tokens[how][3::4] != top[3::4]).all()
    # the refreshed maxima are the final logits' own
    final = jnp.asarray(x).at[jnp.arange(S)[:, None], bias_ids].add(bias_values, mode="drop")
    final = final.at[jnp.arange(S)[:, None], banned_ids].set(-jnp.inf, mode="drop")
    got = refresh_maxima(refresh_maxima(block_maxima(jnp.asarray(x)), final, bias_ids), final, banned_ids)
    np.testing.assert_array_equal(got, block_maxima(final))
