"""The candidates draw on NVIDIA GPUs as Pallas (Triton) kernels: each row does only the work it needs.

sampler.draw_by_candidates in XLA does every stage for every row of the batch: the sort of each row's 8,192
candidates, the threefry noise of the whole row, the 16 best perturbed values and the mass above each (1.35-1.41
ms for 256 x 128,256 on an H100 against greedy's 0.22; benchmarks/RESULTS.md), and a lax.cond for the fallback.
Here (0.61-0.68 ms):
  select, a program a row: the 256 blocks of 32 values with the largest maxima, by bisection over the maxima;
  choose, a program a row: those blocks' values gathered from the row, the top-k value and top-p's threshold
    found by bisection over them in registers (no sort), and the draw itself where they hold the whole kept set
    (greedy rows, top-k rows, top-p on peaked rows): noise for 8,192 values, not the vocabulary;
  drawn, a program per row and part of it, for the rows choose left open only (top-p on flat rows, no filters):
    each part's best perturbed values, merged by XLA into the row's best in order;
  gpu_mass_above, for the rows whose top-p is still open only: the mass above each drawn value;
  exact, for the rare rows still undecided: the sorted definition by passes over the row, so the program needs
    no lax.cond (whose predicate XLA:GPU copies back to the host).
The tokens are draw_by_candidates' (the same thresholds, the same noise: JAX's threefry of the row key at the ids'
pair counts, candidates.pair_counts, here in plain uint32 operations Triton can lower)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..sampling.candidates import BLOCK, BLOCKS, DRAWN, gumbel_of_bits, pair_counts, pair_half
from ..sampling.candidates import ordered_keys as _ordered
from .gpu_division import Scale, scaling
from .gpu_mass_above import mass_above

PART = 2048  # values a `drawn` program perturbs
PER_PART = 4  # best perturbed values each part reports (the row's best in order down to the parts' 4th best)
SELECT_TUNING = (8, 1)  # num_warps, num_stages
CHOOSE_TUNING = (16, 1)  # 8,192 candidates with their noise in registers
DRAWN_TUNING = (4, 1)
EXACT_TUNING = (8, 1)
if os.environ.get("CAPSTAN_DRAWN_TUNING"):  # "num_warps,num_stages,part": a sweep's knob
    _warps, _stages, PART = map(int, os.environ["CAPSTAN_DRAWN_TUNING"].split(","))
    DRAWN_TUNING = (_warps, _stages)
# the merged best perturbed values whose mass above a top-p row still open is summed (a power of two, at most
# DRAWN): a flat row's best is outside its top-p set with about 1 - top_p's chance, so with top-p 0.9 a row needs
# `exact` with ~1e-8's (8) or ~1e-16's (16); each value is a compare and add per logit in gpu_mass_above (issue 64:
# 8 is not yet timed on a GPU; benchmarks/sampled_at_greedy_cost.sh compares them)
MASSES = int(os.environ.get("CAPSTAN_SAMPLER_MASSES", str(DRAWN)))
OPEN, UNDECIDED = -1, -2  # choose's token for rows `drawn` takes, and rows only the fallback decides
ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
NO_ID = jnp.iinfo(jnp.int32).max


def threefry2x32(k0, k1, x0, x1):
    """JAX's threefry2x32 (20 rounds, key injections every 4) in uint32 adds, shifts and xors."""
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << jnp.uint32(r)) | (x1 >> jnp.uint32(32 - r)))
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def gumbel(k0, k1, ids, vocab: int):
    """sampler.gumbel_at for one row's key (k0, k1) at token ids, bit for bit: a threefry call per id."""
    x0, x1, second = pair_counts(ids, vocab)
    b0, b1 = threefry2x32(k0, k1, x0, x1)
    return gumbel_of_bits(jnp.where(second, b1, b0))


def _value(key):
    """The float32 value of an ordered key (the inverse of candidates.ordered_keys)."""
    bits = jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_holding(lo, hi, holds):
    """The largest int32 t in [lo, hi) where holds(t), given holds(lo), not holds(hi), and holds true then false."""

    def narrow(_, bounds):
        lo, hi = bounds
        mid = lo + jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(hi - lo, jnp.uint32) >> jnp.uint32(1), jnp.int32
        )  # hi - lo exact mod 2^32
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return jax.lax.fori_loop(0, 32, narrow, (lo, hi))[0]


def _select(bm_ref, which_ref, t0_ref):
    """The BLOCKS blocks with the largest maxima (ties at the smallest in block order), by bisection over the row's
    block maxima bm_ref [NB] in registers: their ids into which_ref[:BLOCKS], in block order, each at its slot
    (the number of chosen blocks before it), and t0, the smallest of their maxima. The other blocks' ids go after
    them (which_ref is NB long), so the store is a permutation: no lane is masked off, and none writes where
    another does (interpreted on CPU, a masked scatter's lanes aimed at one slot could overwrite a chosen id)."""
    keys = _ordered(bm_ref[...])
    t0_key = _largest_holding(
        jnp.min(keys), jnp.max(keys) + 1, lambda t: jnp.sum((keys >= t).astype(jnp.int32)) >= BLOCKS
    )
    tie = keys == t0_key
    ties_wanted = BLOCKS - jnp.sum((keys > t0_key).astype(jnp.int32))
    chosen = (keys > t0_key) | (tie & (jnp.cumsum(tie.astype(jnp.int32)) <= ties_wanted))
    slot = jnp.cumsum(chosen.astype(jnp.int32)) - 1
    ids = jnp.arange(keys.shape[0], dtype=jnp.int32)
    plgpu.store(which_ref.at[jnp.where(chosen, slot, ids - slot - 1 + BLOCKS)], ids)
    t0_ref[...] = jnp.full(t0_ref.shape, _value(t0_key), jnp.float32)


def _choose(x_ref, which_ref, f_ref, k_ref, key_ref, out_f_ref, out_i_ref, *, vocab: int, scale: Scale):
    top_p, min_p, greedy, z_row, t0 = f_ref[0], f_ref[1], f_ref[2] > 0, f_ref[3], f_ref[4]
    k, k0, k1 = k_ref[0], key_ref[0], key_ref[1]
    C = BLOCKS * BLOCK
    ids = which_ref[...][:, None] * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)[None, :]  # [BLOCKS, BLOCK] token ids
    c = jnp.where(ids < vocab, scale(x_ref[jnp.minimum(ids, vocab - 1)], f_ref[5]), -jnp.inf)
    top_c = jnp.max(c)  # the row's largest value: its block is a candidate
    top = jnp.where(jnp.isfinite(top_c), top_c, 0.0)
    keys = _ordered(c)
    kk = jnp.where(k > 0, jnp.minimum(k, vocab), vocab)
    k_on = kk < vocab
    # top-k: the largest key with at least k candidates at or above it (every value above t0 is a candidate)
    at_least_k = lambda t: jnp.sum((keys >= t).astype(jnp.int32)) >= kk  # noqa: E731
    # a branch's constant is computed from a loaded value: Pallas' Triton lowering of cond yields only values
    kth_key = jax.lax.cond(
        k_on & (kk <= C),
        lambda: _largest_holding(jnp.min(keys), jnp.max(keys) + 1, at_least_k),
        lambda: k * 0 + jnp.iinfo(jnp.int32).min,
    )
    kth = jnp.where(k_on, _value(kth_key), -jnp.inf)
    k_known = ~k_on | (kk <= BLOCKS) | ((kk <= C) & (kth > t0))
    w = jnp.where(c >= kth, jnp.exp(c - top), 0.0)
    p_on = top_p < 1.0
    # top-p renormalises over the top-k set {x >= kth}: from the candidates when they hold all of it, else the
    # row's whole mass (rows without top-k, summed before this kernel); a tie at t0 leaves it to the fallback
    z_known = ~k_on | (kth > t0)
    z = jnp.where(k_on, jnp.sum(w), z_row)
    p_decided = ~p_on | (k_known & z_known & (jnp.sum(jnp.where(c > t0, w, 0.0)) / z >= top_p))

    def top_p_threshold():  # the smallest key whose strictly larger candidates hold less than top_p of the mass
        below_p = lambda t: jnp.sum(jnp.where(keys > t, w, 0.0)) / z < top_p  # noqa: E731
        return _largest_holding(jnp.min(keys) - 1, jnp.max(keys), lambda t: ~below_p(t)) + 1

    pth = jax.lax.cond(p_on & p_decided, lambda: _value(top_p_threshold()), lambda: top_p * 0.0 - jnp.inf)
    floor = jnp.where(min_p > 0, top + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)  # p >= min_p * p_max
    base = jnp.maximum(kth, floor)
    threshold = jnp.maximum(base, pth)

    def draw():  # Gumbel-max over the kept candidates; ties go to the lowest id, as an argmax over the row
        y = jnp.where(c >= threshold, c + gumbel(k0, k1, ids, vocab), -jnp.inf)
        return jnp.min(jnp.where(y == jnp.max(y), ids, NO_ID))

    in_candidates = ~greedy & k_known & p_decided & (threshold > t0)
    token = jax.lax.cond(in_candidates, draw, lambda: k * 0 + OPEN)
    argmax = jnp.min(jnp.where(c == top_c, ids, NO_ID))
    known = k_known & (~p_on | z_known)
    token = jnp.where(greedy, jnp.where(top_c > t0, argmax, UNDECIDED), jnp.where(known, token, UNDECIDED))
    slot4, slot2 = jnp.arange(4), jnp.arange(2)
    out_f_ref[...] = jnp.where(
        slot4 == 0, jnp.where(p_decided, threshold, base), jnp.where(slot4 == 1, kth, jnp.where(slot4 == 2, top, z))
    )
    out_i_ref[...] = jnp.where(slot2 == 0, token, (p_on & ~p_decided).astype(jnp.int32))


def _drawn(x_ref, f_ref, i_ref, key_ref, rowf_ref, y_ref, xs_ref, ids_ref, *, vocab: int, part: int, scale: Scale):
    """A part's PER_PART best perturbed values (with their logits and ids) of a row `choose` left open. With an even
    vocabulary a part is `part` / 2 ids from the row's first half and their pair partners from the second, so one
    threefry call gives both ids' noise (candidates.pair_half); otherwise `part` consecutive ids, a call each."""
    D = y_ref.shape[0]
    paired = vocab % 2 == 0 and pair_half(vocab) >= part // 2
    index = pl.program_id(1)  # outside pl.when: interpreted kernels (CPU tests) cannot read it in a branch

    @pl.when(i_ref[0] == OPEN)
    def _():
        threshold, k0, k1 = f_ref[0], key_ref[0], key_ref[1]
        if paired:
            n, half = part // 2, pair_half(vocab)
            first = index * n
            start = jnp.minimum(first, half - n)  # the last part is the half's last n ids, those before first masked
            lo = start + jnp.arange(n, dtype=jnp.int32)
            b0, b1 = threefry2x32(k0, k1, *pair_counts(lo, vocab)[:2])  # (lo, lo + half): both words used
            t = rowf_ref[5]
            x_lo, x_hi = scale(x_ref[pl.ds(start, n)], t), scale(x_ref[pl.ds(start + half, n)], t)
            ids: tuple[jax.Array, ...] = (lo, lo + half)
            xv: tuple[jax.Array, ...] = (x_lo, x_hi)
            ys: tuple[jax.Array, ...] = tuple(
                jnp.where((lo >= first) & (xi >= threshold), xi + gumbel_of_bits(b), -jnp.inf)
                for xi, b in ((x_lo, b0), (x_hi, b1))
            )
        else:
            first = index * part
            start = jnp.minimum(first, vocab - part)  # the last part is the row's last `part` values, masked
            one = start + jnp.arange(part, dtype=jnp.int32)
            x = scale(x_ref[pl.ds(start, part)], rowf_ref[5])
            ids, xv = (one,), (x,)
            ys = (jnp.where((one >= first) & (x >= threshold), x + gumbel(k0, k1, one, vocab), -jnp.inf),)
        slot = jnp.arange(D)

        def take(d, carry):  # the part's next best perturbed value, its logit and id (lowest id among ties)
            ys, best_ys, best_xs, best_js = carry
            best = functools.reduce(jnp.maximum, [jnp.max(y) for y in ys])
            j = functools.reduce(
                jnp.minimum, [jnp.min(jnp.where(y == best, i, NO_ID)) for y, i in zip(ys, ids, strict=True)]
            )
            xj = functools.reduce(
                jnp.maximum, [jnp.max(jnp.where(i == j, x, -jnp.inf)) for x, i in zip(xv, ids, strict=True)]
            )
            return (
                tuple(jnp.where(i == j, -jnp.inf, y) for y, i in zip(ys, ids, strict=True)),
                jnp.where(slot == d, best, best_ys),
                jnp.where(slot == d, xj, best_xs),
                jnp.where(slot == d, j, best_js),
            )

        none = jnp.full((D,), -jnp.inf, jnp.float32)
        _, best_ys, best_xs, best_js = jax.lax.fori_loop(0, D, take, (ys, none, none, jnp.zeros((D,), jnp.int32)))
        y_ref[...], xs_ref[...], ids_ref[...] = best_ys, best_xs, best_js

    @pl.when(i_ref[0] != OPEN)
    def _():
        y_ref[...] = jnp.full((D,), -jnp.inf, jnp.float32)
        xs_ref[...] = jnp.full((D,), -jnp.inf, jnp.float32)
        ids_ref[...] = jnp.zeros((D,), jnp.int32)


def _fold(x_ref, vocab: int, chunk: int, load, add, acc):
    """acc through add(x, ids, acc) over a row ref in chunks of `chunk` values, each as load(values) gives it; the
    ragged end's values that a whole chunk took are -inf."""

    def step(i, acc):
        start = jnp.minimum(i * chunk, vocab - chunk)
        ids = start + jnp.arange(chunk, dtype=jnp.int32)
        return add(jnp.where(ids >= i * chunk, load(x_ref[pl.ds(start, chunk)]), -jnp.inf), ids, acc)

    return jax.lax.fori_loop(0, -(-vocab // chunk), step, acc)


def _exact(x_ref, f_ref, k_ref, key_ref, token_ref, out_ref, *, vocab: int, chunk: int, scale: Scale):
    """The sorted definition for a row the other kernels left undecided, by passes over the whole row: its top-k
    value and top-p threshold by bisection (a pass a step), then the Gumbel-max draw over what they keep. Slow
    (tens of passes), and rare: top-k beyond the candidates, ties across all of them, or top-p open past the 16
    best perturbed values. Other rows pass their token through."""
    token = token_ref[0]

    @pl.when(token >= 0)
    def _():
        out_ref[...] = jnp.full(out_ref.shape, token, jnp.int32)

    @pl.when(token < 0)
    def _():
        top_p, min_p, greedy, k = f_ref[0], f_ref[1], f_ref[2] > 0, k_ref[0]
        fold = functools.partial(_fold, x_ref, vocab, chunk, lambda x: scale(x, f_ref[5]))
        top = fold(lambda x, ids, m: jnp.maximum(m, jnp.max(x)), top_p * 0.0 - jnp.inf)
        floor_key = _ordered(top_p * 0.0 - jnp.inf)  # the key of -inf: every value is at or above it
        kk = jnp.where(k > 0, jnp.minimum(k, vocab), vocab)
        count_at_least = lambda t: fold(  # noqa: E731
            lambda x, ids, n: n + jnp.sum((_ordered(x) >= t).astype(jnp.int32)), k * 0
        )
        kth = _value(_largest_holding(floor_key, _ordered(top) + 1, lambda t: count_at_least(t) >= kk))
        kth = jnp.where(kk < vocab, kth, -jnp.inf)
        shift = jnp.where(jnp.isfinite(top), top, 0.0)
        z = fold(lambda x, ids, z: z + jnp.sum(jnp.where(x >= kth, jnp.exp(x - shift), 0.0)), top_p * 0.0)
        above = lambda t: fold(  # noqa: E731
            lambda x, ids, m: m + jnp.sum(jnp.where((x >= kth) & (_ordered(x) > t), jnp.exp(x - shift), 0.0)),
            top_p * 0.0,
        )
        pth = _value(_largest_holding(floor_key - 1, _ordered(top), lambda t: above(t) / z >= top_p) + 1)
        pth = jnp.where(top_p < 1.0, pth, -jnp.inf)
        floor = jnp.where(min_p > 0, top + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)  # p >= min_p * p_max
        threshold = jnp.where(greedy, top, jnp.maximum(jnp.maximum(kth, pth), floor))

        def best(x, ids, carry):  # the largest perturbed value kept, lowest id among ties (greedy: x itself)
            value, at = carry
            noise = jnp.where(greedy, 0.0, gumbel(key_ref[0], key_ref[1], ids, vocab))
            y = jnp.where(x >= threshold, x + noise, -jnp.inf)
            m = jnp.max(y)
            here = jnp.min(jnp.where(y == m, ids, NO_ID))
            at = jnp.where(m > value, here, jnp.where(m == value, jnp.minimum(at, here), at))
            return jnp.maximum(m, value), at

        _, at = fold(best, (top_p * 0.0 - jnp.inf, k * 0 + NO_ID))
        out_ref[...] = jnp.full(out_ref.shape, jnp.where(at == NO_ID, 0, at), jnp.int32)


def draw(
    x: jax.Array,
    maxima: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    greedy: jax.Array,
    keys: jax.Array,
    *,
    exact: bool = True,
    interpret: bool = False,
    temperature: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Tokens [S] and whether each is decided, for rows x [S, V] whose blocks of BLOCK values have the maxima
    [S, ceil(V / BLOCK)] (more than BLOCKS); keys [S, 2] the rows' threefry key data. A row the candidates leave
    undecided (top-k beyond them, a tie across all of them, top-p open past the parts' best values) is decided
    by the `_exact` kernel, or with exact=False left to the caller's fallback. temperature [S]: x is the rows'
    unscaled logits, each kernel dividing what it loads by it (no scaled copy of the logits is written), and
    the maxima are those of x / temperature."""
    S, V = x.shape
    x = x.astype(jnp.float32)
    scale = scaling(temperature, interpret)
    part = min(PART, 1 << (V.bit_length() - 1))  # a power of two no longer than the row
    width = 1 << (maxima.shape[1] - 1).bit_length()  # the maxima padded to a power of two
    maxima = jnp.pad(maxima.astype(jnp.float32), ((0, 0), (0, width - maxima.shape[1])), constant_values=-jnp.inf)
    row = lambda n: pl.BlockSpec((None, n), lambda s, *_: (s, 0))  # noqa: E731
    # the whole row's mass where top-p needs it and top-k does not bound it to the candidates
    top = jnp.max(maxima, axis=1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    whole = (top_p < 1.0) & ((top_k <= 0) | (top_k >= V))
    z_row = mass_above(
        x,
        jnp.full((S,), -jnp.inf),
        top,
        jnp.full((S, 2), -jnp.inf),
        rows=whole,
        interpret=interpret,
        temperature=temperature,
    )[:, 0]
    which, t0 = pl.pallas_call(
        _select,
        grid=(S,),
        in_specs=[row(width)],
        out_specs=[row(width), row(2)],
        out_shape=[jax.ShapeDtypeStruct((S, width), jnp.int32), jax.ShapeDtypeStruct((S, 2), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=SELECT_TUNING[0], num_stages=SELECT_TUNING[1]),
        interpret=interpret,
        name="sampler_select",
    )(maxima)
    zero = jnp.zeros_like(top_p)
    t = zero + 1.0 if temperature is None else temperature.astype(jnp.float32)
    rowf = jnp.stack([top_p, min_p, greedy.astype(jnp.float32), z_row, t0[:, 0], t, zero, zero], axis=1)
    rowk = jnp.stack([top_k, jnp.zeros_like(top_k)], axis=1).astype(jnp.int32)
    keys = keys.astype(jnp.uint32)
    warps, stages = CHOOSE_TUNING
    out_f, out_i = pl.pallas_call(
        functools.partial(_choose, vocab=V, scale=scale),
        grid=(S,),
        in_specs=[row(V), row(BLOCKS), row(8), row(2), row(2)],
        out_specs=[row(4), row(2)],
        out_shape=[jax.ShapeDtypeStruct((S, 4), jnp.float32), jax.ShapeDtypeStruct((S, 2), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="sampler_choose",
    )(x, which, rowf, rowk, keys)
    token, p_open = out_i[:, 0], out_i[:, 1] > 0
    kth, top, z = out_f[:, 1], out_f[:, 2], out_f[:, 3]
    parts = -(-V // part)
    warps, stages = DRAWN_TUNING
    part_spec = pl.BlockSpec((None, None, PER_PART), lambda s, p: (s, p, 0))
    ys, xs, js = pl.pallas_call(
        functools.partial(_drawn, vocab=V, part=part, scale=scale),
        grid=(S, parts),
        in_specs=[row(V), row(4), row(2), row(2), row(8)],
        out_specs=[part_spec] * 3,
        out_shape=[jax.ShapeDtypeStruct((S, parts, PER_PART), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct((S, parts, PER_PART), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="sampler_drawn",
    )(x, out_f, out_i, keys, rowf)
    # the row's best perturbed values in order, exact down to the largest of the parts' last reported values
    boundary = jnp.max(ys[:, :, -1], axis=1)
    n = min(MASSES, DRAWN, parts * PER_PART)
    drawn, order = jax.lax.top_k(ys.reshape(S, -1), n)
    ids = jnp.take_along_axis(js.reshape(S, -1), order, axis=-1)
    xd = jnp.take_along_axis(xs.reshape(S, -1), order, axis=-1)
    in_order = (drawn > boundary[:, None]) | (jnp.arange(n) == 0)[None, :]
    above = mass_above(x, kth, top, xd, rows=p_open, interpret=interpret, temperature=temperature) / z[:, None]
    kept = (drawn > -jnp.inf) & in_order & (~p_open[:, None] | (above < top_p[:, None]))
    opened = jnp.take_along_axis(ids, jnp.argmax(kept, axis=-1)[:, None], axis=-1)[:, 0]
    tokens = jnp.where(token >= 0, token, opened)
    decided = (token >= 0) | ((token == OPEN) & jnp.any(kept, axis=-1))
    if not exact:
        return tokens, decided
    tokens = pl.pallas_call(  # the undecided rows by the definition, in a kernel: no lax.cond, no host round trip
        functools.partial(_exact, vocab=V, chunk=part, scale=scale),
        grid=(S,),
        in_specs=[row(V), row(8), row(2), row(2), row(2)],
        out_specs=row(2),
        out_shape=jax.ShapeDtypeStruct((S, 2), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=EXACT_TUNING[0], num_stages=EXACT_TUNING[1]),
        interpret=interpret,
        name="sampler_exact",
    )(x, rowf, rowk, keys, jnp.stack([jnp.where(decided, tokens, -1)] * 2, axis=1))[:, 0]
    return tokens, jnp.ones_like(decided)
