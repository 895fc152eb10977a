"""On-device sampling for a padded batch of S rows: processors, then greedy or seeded Gumbel-max sampling.

Order as in vLLM: logit_bias and min_tokens bans, penalties, temperature, top-k / top-p / min-p, sample.
Logprobs are of the model's raw distribution. A row's random key depends only on its seed and the position
it samples, so a seeded request draws the same tokens alone or in any batch."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Generic, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from ..arrays import HostOrDevice
from ..limits import MAX_LOGPROBS
from .candidates import BLOCK, BLOCKS, DRAWN, gumbel_of_bits, ordered_keys, pair_counts, pair_half
from .dry import DryParams, dry_penalty, push_recent, recent_tokens


class SamplingBatch(eqx.Module, Generic[HostOrDevice]):
    temperature: HostOrDevice  # [S] f32; 0 = greedy
    top_k: HostOrDevice  # [S] i32; 0 = off
    top_p: HostOrDevice  # [S] f32
    min_p: HostOrDevice  # [S] f32
    presence_penalty: HostOrDevice  # [S] f32
    frequency_penalty: HostOrDevice  # [S] f32
    repetition_penalty: HostOrDevice  # [S] f32
    key_data: HostOrDevice  # [S, 2] u32: the row's threefry key before folding in the position
    position: HostOrDevice  # [S] i32: position of the token being sampled
    bias_ids: HostOrDevice  # [S, B] i32, vocab_size = unused
    bias_values: HostOrDevice  # [S, B] f32
    banned_ids: HostOrDevice  # [S, E] i32: ids forbidden this step (eos/stop ids below min_tokens); vocab_size = unused
    history: HostOrDevice  # [S, H] i32: prompt then output tokens, vocab_size = unused (read only with penalties)
    prompt_lens: HostOrDevice  # [S] i32: history[:, :prompt_len] is the prompt
    allowed: HostOrDevice  # [S, ceil(V/32)] i32: bit j of word w allows token 32w + j (structured outputs)
    any_constrained: HostOrDevice  # [] bool: some row has a grammar (else `allowed` is never read)
    any_penalty: HostOrDevice  # [] bool
    any_filter: HostOrDevice  # [] bool: some row uses top-k, top-p or min-p
    want_logprobs: HostOrDevice  # [] bool
    plain_greedy: (
        HostOrDevice  # [] bool: every row greedy without bias, bans or penalties: the argmax of the raw logits
    )
    dry: DryParams[HostOrDevice] | None = None  # DRY's parameters (sampling/dry.py); None: a batch without DRY
    # [S, E] i32: each row's stop tokens (EOS unless ignore_eos, stop_token_ids), which the repetition penalty leaves
    # alone; vocab_size = unused (read only with penalties); None: no row has any
    stop_ids: HostOrDevice | None = None


class SampleResult(eqx.Module):
    tokens: jax.Array  # [S] i32
    logprob: jax.Array  # [S] f32: raw log-probability of the chosen token (0 where the branches want no logprobs)
    rank: jax.Array  # [S] i32: 1 + number of tokens more likely than it
    top_ids: jax.Array  # [S, MAX_LOGPROBS] i32
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] f32


class PromptLogprobs(eqx.Module):
    logprob: jax.Array  # [T] f32 of each prompt token's successor (StepInputs.prompt_targets)
    rank: jax.Array  # [T] i32
    top_ids: jax.Array  # [T, MAX_LOGPROBS] i32
    top_logprobs: jax.Array  # [T, MAX_LOGPROBS] f32


class StepOutputs(eqx.Module):
    """What a step samples: a token per row, and the prompt tokens' log-probabilities."""

    sampled: SampleResult
    prompt: PromptLogprobs | None  # None: a speculative verify step (its requests ask for no prompt logprobs)


class PenaltyCounts(eqx.Module):
    """What the penalties read of a row's history: a multi-step decode carries these from step to step (adding each
    sampled token) instead of its history."""

    output: jax.Array  # [S, V] f32: times each token was generated (frequency and presence penalties)
    seen: jax.Array  # [S, V] bool: in the prompt or generated (repetition penalty)
    recent: jax.Array | None = None  # [S, DRY_WINDOW] i32: the last tokens, for DRY (None: a batch without DRY)


def penalty_counts(b: SamplingBatch[jax.Array], vocab: int) -> PenaltyCounts:
    """The counts of each row's history (prompt, then output tokens; vocab = unused)."""
    S = b.history.shape[0]
    rows = jnp.arange(S)[:, None]
    is_output = jnp.arange(b.history.shape[1])[None, :] >= b.prompt_lens[:, None]
    output = jnp.zeros((S, vocab), jnp.float32).at[rows, b.history].add(is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((S, vocab), jnp.bool_).at[rows, b.history].set(True, mode="drop")
    return PenaltyCounts(output, seen, None if b.dry is None else recent_tokens(b.history, vocab))


def count_sampled(counts: PenaltyCounts, tokens: jax.Array) -> PenaltyCounts:
    """The counts after each row's sampled token [S] joined its output."""
    rows = jnp.arange(tokens.shape[0])
    recent = None if counts.recent is None else push_recent(counts.recent, tokens)
    return PenaltyCounts(counts.output.at[rows, tokens].add(1.0), counts.seen.at[rows, tokens].set(True), recent)


class Branches(NamedTuple):
    """A batch's sampling branches decided on the host (None: left to a lax.cond on the batch's flag). A program
    compiled for them has no lax.cond, whose predicate XLA:GPU copies back to the host: the host would wait there
    for the device to catch up, and could not queue the next program meanwhile (the decode pipeline for grammars
    needs it to)."""

    plain_greedy: bool | None
    any_constrained: bool | None
    any_penalty: bool | None
    any_filter: bool | None
    all_greedy: bool | None
    want_logprobs: bool | None
    any_dry: bool | None = None  # inside the penalties' branch


def _branch(static: bool | None, traced: jax.Array, yes, no, *args):
    return jax.lax.cond(traced, yes, no, *args) if static is None else (yes if static else no)(*args)


def sample(
    logits: jax.Array,
    b: SamplingBatch[jax.Array],
    branches: Branches | None = None,
    counts: PenaltyCounts | None = None,
) -> SampleResult:
    """branches: decided on the host (static), else each is a lax.cond on the batch's flags. counts: what the
    penalties read (a multi-step decode's, carried from step to step); None: counted from b.history."""
    S, V = logits.shape
    logits = logits.astype(jnp.float32)
    # the chosen tokens' log-probabilities are read only for rows that asked for logprobs (engine._append_token):
    # where the host knows none did, the normaliser's pass over the logits is left out (256 x 128k float32 on an
    # H100: ~44 us of a ~3 ms decode step) and the result's logprob is 0
    no_logprobs = branches is not None and branches.want_logprobs is False
    log_z = None if no_logprobs else jax.nn.logsumexp(logits, axis=-1)  # log-probabilities only when asked
    # a plain greedy batch (the common serving case) skips every processor: one argmax over the raw logits
    tokens = _branch(
        branches and branches.plain_greedy,
        b.plain_greedy,
        lambda x, b: first_max(x).astype(jnp.int32),
        lambda x, b: _processed_sample(x, b, branches, counts),
        logits,
        b,
    )
    chosen = (
        jnp.zeros((S,), jnp.float32)
        if log_z is None
        else jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_z
    )

    def with_logprobs(logits):
        assert log_z is not None, "branches that want no logprobs never take this branch"
        lp = logits - log_z[:, None]
        top_lp, top_ids = top_logprobs(lp)
        rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1)
        return rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_lp

    rank, top_ids, top_lp = _branch(
        branches and branches.want_logprobs, b.want_logprobs, with_logprobs, lambda _: _no_logprobs(S), logits
    )
    return SampleResult(tokens, chosen, rank, top_ids, top_lp)


def _no_logprobs(S: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The rank and top logprobs of rows that asked for none."""
    return jnp.ones((S,), jnp.int32), jnp.zeros((S, MAX_LOGPROBS), jnp.int32), jnp.zeros((S, MAX_LOGPROBS), jnp.float32)


def plain_greedy_result(tokens: jax.Array, chosen: jax.Array) -> SampleResult:
    """A plain greedy batch's result (the argmax of the raw logits and its log-probability, no logprobs asked) from
    tokens picked elsewhere: parallel/vocab_greedy.py, on logits left split by vocabulary."""
    return SampleResult(tokens, chosen, *_no_logprobs(tokens.shape[0]))


def is_plain_greedy(branches: Branches | None) -> bool:
    """Whether these (host-decided) branches are a plain greedy batch's without logprobs."""
    return branches is not None and branches.plain_greedy is True and branches.want_logprobs is False


def _processed_sample(
    logits: jax.Array,
    b: SamplingBatch[jax.Array],
    branches: Branches | None = None,
    counts: PenaltyCounts | None = None,
) -> jax.Array:
    """Bias, bans, penalties, temperature and filters, then greedy rows take the argmax and the rest draw."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]
    greedy = b.temperature == 0.0
    t = jnp.where(greedy, 1.0, b.temperature)[:, None]

    def biased(x, t):  # logit_bias (scaled as x is) and min_tokens bans, then the grammar's mask
        x = x.at[rows, b.bias_ids].add(b.bias_values / t, mode="drop")
        x = x.at[rows, b.banned_ids].set(-jnp.inf, mode="drop")
        return _branch(
            branches and branches.any_constrained, b.any_constrained, _apply_grammar, lambda x, allowed: x, x, b.allowed
        )

    # penalties read the unscaled logits (vLLM's order: bias, bans, penalties, temperature); without them the
    # temperature comes first, so the scaled copy is the buffer the bias is added into (the scatters would
    # otherwise copy the logits, which the log-probabilities still read: 82 us for 256 x 128k on an H100)
    name = filters_name(jax.default_backend())
    kernels: dict[str, jax.Array] = {}  # draw_by_kernels' block maxima (and temperature), where taken here
    how = premaxima()
    host_plain = name == "kernels" and branches and branches.any_penalty is False and branches.any_constrained is False
    if host_plain and how == "load" and branches and branches.any_filter is True:
        # the kernels read the raw logits with the bias and bans (vLLM's order: before the temperature; the scatters
        # write into the logits' own buffer where no logprobs read them) and divide by the temperature as they
        # load: no scaled copy written and read back. Division by t > 0 is monotone: x's block maxima over t are
        # x / t's. (Only for a program that always filters: greedy rows' t is 1, and every row draws in a kernel.)
        x = biased(logits, 1.0)
        kernels = {"maxima": block_maxima(x) / t, "temperature": t[:, 0]}
    elif host_plain and how in ("scaled", "raw"):
        # the block maxima of the scaled logits from the pass that scales them (so that XLA can fuse the reduction
        # into the divide, and the maxima need not read the scaled copy again: unmeasured), then the blocks the
        # bias and bans touched read again: exact, so the kernels' candidates are those of the final logits
        y = logits / t
        maxima = block_maxima(y) if how == "scaled" else block_maxima(logits) / t  # monotone: the same maxima
        x = biased(y, t)
        maxima = refresh_maxima(maxima, x, b.bias_ids)
        kernels = {"maxima": refresh_maxima(maxima, x, b.banned_ids)}
    else:
        x = _branch(
            branches and branches.any_penalty,
            b.any_penalty,
            lambda x: _apply_penalties(biased(x, 1.0), b, counts, branches) / t,
            lambda x: biased(x / t, t),
            logits,
        )
    noise = RowNoise(row_keys(b), V)
    filtered = (
        (lambda x: DRAWS[name](x, b, greedy, noise, **kernels))
        if name in DRAWS
        else (lambda x: _draw_kept(FILTERS[name](x, b), greedy, noise))
    )

    def sampled(x):
        return _branch(branches and branches.any_filter, b.any_filter, filtered, lambda x: _draw(x, greedy, noise), x)

    return _branch(branches and branches.all_greedy, jnp.all(greedy), first_max, sampled, x).astype(jnp.int32)


KEPT = 64  # _draw_kept: rows keeping at most this many tokens draw their noise at those ids only


def premaxima() -> str:
    """How the kernels' block maxima are taken where the host decided a sampled batch without penalties or
    grammars: "" (the default) after the bias scatters, from the final logits; "scaled" from the scaled logits in
    the pass that scales them, "raw" from the raw logits over the temperature (both exact: the blocks the bias and
    bans touched are taken again); "load": no scaled copy at all, the kernels reading the raw logits with the bias
    and bans and dividing by the temperature as they load (gpu_division.py), the maxima the raw ones over the
    temperature. "scaled" and "raw" were timed on an H100 (benchmarks/RESULTS.md, thirty-eighth session: under 1%)
    and stay off; "load" is not yet timed or run on a GPU (issue 64's item 2: the scaled copy is ~83 us of a 256-row
    step), so off until benchmarks/sampled_at_greedy_cost.sh has compared it. CAPSTAN_SAMPLER_PREMAXIMA picks one."""
    how = os.environ.get("CAPSTAN_SAMPLER_PREMAXIMA", "")
    if how not in ("scaled", "raw", "load", ""):
        raise ValueError(f"CAPSTAN_SAMPLER_PREMAXIMA={how!r}: not one of scaled, raw, load or empty")
    return how


def block_maxima(x: jax.Array) -> jax.Array:
    """[S, ceil(V / BLOCK)]: each block of BLOCK values' maximum (the ragged last block padded with -inf)."""
    S, V = x.shape
    nb = -(-V // BLOCK)
    blocks = jnp.pad(x, ((0, 0), (0, nb * BLOCK - V)), constant_values=-jnp.inf).reshape(S, nb, BLOCK)
    return jnp.max(blocks, axis=-1)


def refresh_maxima(maxima: jax.Array, x: jax.Array, ids: jax.Array) -> jax.Array:
    """The block maxima with the blocks holding ids [S, E] (out of range: the last block) taken again from x."""
    S, V = x.shape
    nb = maxima.shape[1]
    blk = jnp.clip(ids // BLOCK, 0, nb - 1)  # [S, E]
    at = blk[:, :, None] * BLOCK + jnp.arange(BLOCK, dtype=blk.dtype)  # [S, E, BLOCK]
    values = jnp.take_along_axis(x, jnp.minimum(at, V - 1).reshape(S, -1), axis=-1).reshape(at.shape)
    fresh = jnp.max(jnp.where(at < V, values, -jnp.inf), axis=-1)
    return maxima.at[jnp.arange(S)[:, None], blk].set(fresh)


def row_keys(b: SamplingBatch[jax.Array]) -> jax.Array:
    """[S, 2] u32: each row's key data with the position it samples folded in."""
    return jax.vmap(lambda k, p: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), p)))(
        b.key_data, b.position
    )


class RowNoise:
    """Each row's Gumbel noise, a function of its key [S, 2] (row_keys) and the token id only: [S, V], or [S, n]
    at ids."""

    def __init__(self, keys: jax.Array, vocab: int):
        self.keys, self.vocab = keys, vocab

    def __call__(self, ids: jax.Array | None = None) -> jax.Array:
        return gumbel_row(self.keys, self.vocab) if ids is None else gumbel_at(self.keys, ids, self.vocab)


def gumbel_at(keys: jax.Array, ids: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise [S, n] for token ids [S or 1, n] of a vocab-long row under each row's key data [S, 2]: any id's
    noise can be drawn alone, and it is bit for bit what jax.random.gumbel(key, (vocab,))[id] gives under
    jax.threefry_partitionable(False) (candidates.pair_counts), so seeded outputs are those of the full-row draw."""
    x0, x1, second = pair_counts(ids, vocab)
    b0, b1 = _threefry_words(keys, x0, x1)
    return gumbel_of_bits(jnp.where(second, b1, b0))


def gumbel_row(keys: jax.Array, vocab: int) -> jax.Array:
    """gumbel_at over the whole row [S, vocab], one threefry call per two ids: the first half's calls give both."""
    x0, x1, _ = pair_counts(jnp.arange(pair_half(vocab))[None, :], vocab)
    return gumbel_of_bits(jnp.concatenate(_threefry_words(keys, x0, x1), axis=1)[:, :vocab])


def _threefry_words(keys: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """threefry2x32's two output words under each row's key data [S, 2] at counts [S or 1, n]."""
    shape = jnp.broadcast_shapes(keys[:, :1].shape, x0.shape)
    k0, k1 = jnp.broadcast_to(keys[:, :1], shape), jnp.broadcast_to(keys[:, 1:], shape)
    return tuple(threefry2x32_p.bind(k0, k1, jnp.broadcast_to(x0, shape), jnp.broadcast_to(x1, shape)))


def _apply_grammar(x: jax.Array, allowed: jax.Array) -> jax.Array:
    """Tokens the row's grammar does not allow next get -inf (unconstrained rows allow every bit)."""
    S, V = x.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    return jnp.where(bits.reshape(S, -1)[:, :V].astype(jnp.bool_), x, -jnp.inf)


def _apply_penalties(
    x: jax.Array,
    b: SamplingBatch[jax.Array],
    counts: PenaltyCounts | None = None,
    branches: Branches | None = None,
) -> jax.Array:
    """Repetition, frequency and presence penalties, then DRY (llama.cpp's order)."""
    counts = penalty_counts(b, x.shape[1]) if counts is None else counts
    rep = b.repetition_penalty[:, None]
    seen = counts.seen
    if b.stop_ids is not None:
        # a row's stop tokens are not repeats (a departure from vLLM, whose repetition penalty covers every prompt
        # token): chat templates end every message of the prompt with the end-of-turn token, so penalising it would
        # hold back the end of every answer (issue 67). The frequency and presence penalties count only the output,
        # which a stop token ends.
        seen = seen.at[jnp.arange(x.shape[0])[:, None], b.stop_ids].set(False, mode="drop")
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - b.frequency_penalty[:, None] * counts.output
    x = x - b.presence_penalty[:, None] * (counts.output > 0)
    if b.dry is None:
        return x
    dry, V = b.dry, x.shape[1]
    recent = recent_tokens(b.history, V) if counts.recent is None else counts.recent
    return _branch(
        branches and branches.any_dry, dry.any_dry, lambda x: x - dry_penalty(recent, dry, V), lambda x: x, x
    )


def filters_by_search(x: jax.Array, b: SamplingBatch[jax.Array], pivots: int = 1) -> jax.Array:
    """Top-k, then top-p over what top-k kept (renormalised), then min-p; exact, without sorting the vocabulary:
    each threshold is searched for over the float32 values' ordered bit patterns, `pivots` candidates per pass
    over the row (1: bisection, 32 passes; 15: 8 passes that each compare every value with 15 candidates), so
    it is one of the row's own values and the kept set is the one a full sort would give."""
    S, V = x.shape
    keys = ordered_keys(x)  # [S, V] int32, ordered as x
    k = jnp.where(b.top_k > 0, jnp.minimum(b.top_k, V), V)
    # top-k: the largest value t with at least k values >= t
    counts_reach_k = lambda t: jnp.sum(keys[:, :, None] >= t[:, None, :], axis=1) >= k[:, None]  # noqa: E731
    kth = jax.lax.cond(
        jnp.any(k < V),
        lambda: _search(keys, counts_reach_k, pivots),
        lambda: jnp.full((S,), jnp.iinfo(jnp.int32).min, jnp.int32),
    )
    x = jnp.where(keys >= kth[:, None], x, -jnp.inf)
    probs = jax.nn.softmax(x, axis=-1)  # top-p renormalises after top-k

    def top_p_threshold():
        # the smallest value s whose strictly-larger values hold less than top_p of the mass: s and all above stay
        def mass_reaches_p(t):
            above = jnp.sum(jnp.where(keys[:, :, None] > t[:, None, :], probs[:, :, None], 0.0), axis=1)
            return above >= b.top_p[:, None]

        return _search(keys, mass_reaches_p, pivots, smallest_false=True)

    pth = jax.lax.cond(jnp.any(b.top_p < 1.0), top_p_threshold, lambda: kth)
    pth = jnp.where(b.top_p < 1.0, pth, kth)
    keep = (keys >= jnp.maximum(kth, pth)[:, None]) & (x > -jnp.inf)
    top = jnp.max(x, axis=-1, keepdims=True)
    min_p_floor = top + jnp.log(jnp.maximum(b.min_p, 1e-30))[:, None]  # p >= min_p * p_max
    keep &= jnp.where(b.min_p[:, None] > 0, x >= min_p_floor, True)
    return jnp.where(keep, x, -jnp.inf)


def draw_by_top(x: jax.Array, b: SamplingBatch[jax.Array], greedy: jax.Array, noise) -> jax.Array:
    """filters_by_top, then _draw_kept, in one: where the KEPT largest values decide every row's kept set and
    hold all of it, the draw perturbs those candidates (the noise at their ids) instead of taking a second top-k
    of the filtered row (0.10 ms of the default model's 6.5 ms one-row sampled step on CPU). The same tokens:
    the same kept set, in the same order, and noise that is a function of the key and the id."""
    if x.shape[1] <= KEPT:
        return _draw_kept(filters_by_top(x, b), greedy, noise)
    threshold, decided, ids, values = top_candidates(x, b)

    def kept() -> jax.Array:
        return jnp.where(x >= threshold[:, None], x, -jnp.inf)

    def among_candidates() -> jax.Array:
        perturbed = jnp.where(values >= threshold[:, None], values + noise(ids), -jnp.inf)
        drawn = jnp.take_along_axis(ids, jnp.argmax(perturbed, axis=-1)[:, None], axis=-1)[:, 0]
        # greedy rows take the filtered row's argmax, as _draw_kept does (the filters always keep the maximum)
        first = jax.lax.cond(jnp.any(greedy), lambda: first_max(kept()), lambda: jnp.zeros_like(drawn))
        return jnp.where(greedy, first, drawn)

    def otherwise() -> jax.Array:
        return _draw_kept(jax.lax.cond(jnp.all(decided), kept, lambda: filters_by_bisection(x, b)), greedy, noise)

    # a sampled row's kept set lies among its candidates when the last of them is below its threshold (ties too)
    inside = (values[:, -1] < threshold) | greedy
    return jax.lax.cond(jnp.all(decided & inside), among_candidates, otherwise)


def filters_by_bisection(x: jax.Array, b: SamplingBatch[jax.Array]) -> jax.Array:
    return filters_by_search(x, b, pivots=1)


def top_thresholds(x: jax.Array, b: SamplingBatch[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Each row's kept-set threshold found among its KEPT largest values, as filters_by_sort defines it, and whether
    they decide it: a top-k within them (or none), and a top-p whose mass they reach (or none). Entries past them
    have at least their mass above, so they are out of such a top-p. ([S] thresholds, [S] decided.)"""
    threshold, decided, _, _ = top_candidates(x, b)
    return threshold, decided


def top_candidates(x: jax.Array, b: SamplingBatch[jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """top_thresholds, and the KEPT largest values' ids and values ([S, KEPT] each, descending) it read."""
    S, V = x.shape
    # the values gathered by their ids: XLA:CPU keeps a top-k whose values feed several fusions as a full sort of
    # the row (its TopK rewrite needs the sort's slice intact; measured 60x slower)
    ids = jax.lax.top_k(x, KEPT)[1]
    values = jnp.take_along_axis(x, ids, axis=-1)  # descending
    k = jnp.where(b.top_k > 0, jnp.minimum(b.top_k, V), V)
    in_k = jnp.arange(KEPT)[None, :] < k[:, None]
    kth = jnp.where(k <= KEPT, jnp.take_along_axis(values, jnp.clip(k - 1, 0, KEPT - 1)[:, None], axis=-1)[:, 0],
                    -jnp.inf)  # fmt: skip
    # top-p renormalises over what top-k kept: the candidates alone when k is among them, else the whole row
    log_z = jnp.where(k <= KEPT, jax.nn.logsumexp(jnp.where(in_k, values, -jnp.inf), axis=-1),
                      jax.nn.logsumexp(x, axis=-1))  # fmt: skip
    probs = jnp.where(in_k, jnp.exp(values - log_z[:, None]), 0.0)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    pth = jnp.min(jnp.where(in_k & (before < b.top_p[:, None]), values, jnp.inf), axis=-1)
    pth = jnp.where(b.top_p < 1.0, pth, -jnp.inf)
    threshold = jnp.maximum(kth, pth)
    min_p_floor = values[:, 0] + jnp.log(jnp.maximum(b.min_p, 1e-30))  # p >= min_p * p_max
    threshold = jnp.where(b.min_p > 0, jnp.maximum(threshold, min_p_floor), threshold)
    decided = ((k <= KEPT) | (k >= V)) & ((b.top_p >= 1.0) | (jnp.sum(probs, axis=-1) >= b.top_p))
    return threshold, decided, ids, values


def filters_by_top(x: jax.Array, b: SamplingBatch[jax.Array]) -> jax.Array:
    """filters_by_sort's kept set from the KEPT largest values of each row (top_thresholds: a top-k of XLA's, one
    logsumexp), where they decide every row of the batch; else the bisection. On CPU the bisection's 32 passes over
    the default model's 49,152 logits cost ~1-3 ms a step; the candidates' way ~0.15 ms."""
    if x.shape[1] <= KEPT:
        return filters_by_bisection(x, b)
    threshold, decided = top_thresholds(x, b)
    return jax.lax.cond(
        jnp.all(decided),
        lambda: jnp.where(x >= threshold[:, None], x, -jnp.inf),
        lambda: filters_by_bisection(x, b),
    )


def best_by_top_k(x: jax.Array, threshold: jax.Array, noise) -> tuple[jax.Array, jax.Array]:
    """The DRAWN largest perturbed values x + noise at or above each row's threshold, and their ids: XLA's top-k."""
    return jax.lax.top_k(jnp.where(x >= threshold[:, None], x + noise(), -jnp.inf), DRAWN)


def best_by_blocks(x: jax.Array, threshold: jax.Array, noise) -> tuple[jax.Array, jax.Array]:
    """The same by the blocks' trick: the DRAWN largest lie in the DRAWN blocks with the largest maxima, so one
    fused max-reduction over the row (its noise never stored) and a top-k over DRAWN blocks' values find them."""
    S, V = x.shape
    nb = -(-V // BLOCK)
    ids = jnp.arange(nb * BLOCK)[None, :]
    y = jnp.pad(x, ((0, 0), (0, nb * BLOCK - V)), constant_values=-jnp.inf)
    y = jnp.where(y >= threshold[:, None], y + noise(jnp.minimum(ids, V - 1)), -jnp.inf)
    _, which = jax.lax.top_k(jnp.max(y.reshape(S, nb, BLOCK), axis=-1), DRAWN)
    ids = (which[:, :, None] * BLOCK + jnp.arange(BLOCK)).reshape(S, DRAWN * BLOCK)
    xc = jnp.where(ids < V, jnp.take_along_axis(x, jnp.minimum(ids, V - 1), axis=-1), -jnp.inf)
    drawn, j = jax.lax.top_k(jnp.where(xc >= threshold[:, None], xc + noise(jnp.minimum(ids, V - 1)), -jnp.inf), DRAWN)
    return drawn, jnp.take_along_axis(ids, j, axis=-1)


def draw_by_candidates(
    x: jax.Array,
    b: SamplingBatch[jax.Array],
    greedy: jax.Array,
    noise,
    fallback=None,
    best=best_by_top_k,
    in_one_pass: bool = False,
) -> jax.Array:
    """Top-k, top-p and min-p, then the Gumbel-max draw, without sorting the vocabulary; the same tokens as
    `fallback`'s kept set with the same noise. Each row's candidates are the values of its BLOCKS blocks with the
    largest maxima: every value above t0 (the smallest of those maxima) is among them, so once sorted they give
    the k-th value exactly for k <= BLOCKS, and top-p's threshold when the values above t0 hold at least top_p of
    the mass (peaked rows, as trained models give). Where top-p is not decided that way (flat rows), the draw
    checks its DRAWN best perturbed values, best first: the first whose mass above is below top_p is the token
    the full kept set would give. A batch with a row neither decides takes `fallback` (a full sort).
    in_one_pass: those masses from gpu_mass_above's one pass over each row, not one XLA reduction per value."""
    S, V = x.shape
    fallback = fallback or filters_by_sort
    nb = -(-V // BLOCK)
    if nb <= BLOCKS:  # a small vocabulary: sorting it is the cheap way
        return _draw(fallback(x, b), greedy, noise)
    c, t0 = block_candidates(x)
    top = jnp.where(jnp.isfinite(c[:, 0]), c[:, 0], 0.0)
    k = jnp.where(b.top_k > 0, jnp.minimum(b.top_k, V), V)
    k_on, p_on = k < V, b.top_p < 1.0
    kc = jnp.take_along_axis(c, jnp.clip(k - 1, 0, c.shape[1] - 1)[:, None], axis=-1)[:, 0]
    kth = jnp.where(k_on, kc, -jnp.inf)
    k_known = ~k_on | (k <= BLOCKS) | ((k <= c.shape[1]) & (kc > t0))  # every value above t0 is a candidate
    # top-p renormalises over the top-k set {x >= kth}: its mass from one pass over the row
    weights = jnp.where(x >= kth[:, None], jnp.exp(x - top[:, None]), 0.0)
    z = jnp.sum(weights, axis=-1)
    pc = jnp.where(c >= kth[:, None], jnp.exp(c - top[:, None]), 0.0) / z[:, None]
    before = jnp.cumsum(pc, axis=-1) - pc  # exact mass above each candidate above t0
    pth = jnp.min(jnp.where(before < b.top_p[:, None], c, jnp.inf), axis=-1)
    p_by_blocks = ~p_on | (k_known & (jnp.sum(jnp.where(c > t0[:, None], pc, 0.0), axis=-1) >= b.top_p))
    floor = jnp.where(b.min_p > 0, top + jnp.log(jnp.maximum(b.min_p, 1e-30)), -jnp.inf)  # p >= min_p * p_max
    threshold = jnp.maximum(jnp.maximum(kth, floor), jnp.where(p_on & p_by_blocks, pth, -jnp.inf))
    drawn, ids = best(x, threshold, noise)
    # rows whose top-p is still open: the mass above each drawn value (a row reduction per drawn value)
    xd = jnp.take_along_axis(x, ids, axis=-1)
    if in_one_pass:
        from ..kernels.gpu_mass_above import mass_above as one_pass

        above = one_pass(x, kth, top, xd, interpret=jax.default_backend() != "gpu") / z[:, None]
    else:
        above = mass_above(x, weights, xd) / z[:, None]
    kept = (drawn > -jnp.inf) & (p_by_blocks[:, None] | (above < b.top_p[:, None]))
    token = jnp.take_along_axis(ids, jnp.argmax(kept, axis=-1)[:, None], axis=-1)[:, 0]
    decided = greedy | (k_known & jnp.any(kept, axis=-1))
    tokens = jnp.where(greedy, jnp.argmax(x, axis=-1), token)
    return jax.lax.cond(jnp.all(decided), lambda: tokens, lambda: _draw(fallback(x, b), greedy, noise))


def draw_by_kernels(
    x: jax.Array,
    b: SamplingBatch[jax.Array],
    greedy: jax.Array,
    noise: RowNoise,
    fallback=None,
    maxima: jax.Array | None = None,
    temperature: jax.Array | None = None,
) -> jax.Array:
    """draw_by_candidates' tokens from gpu_sampler's Pallas kernels, where each row does only the stages it needs
    (the candidate blocks and thresholds by bisection in registers, the vocabulary's noise only for rows whose
    kept set reaches past the candidates). The block maxima are XLA's. A row the candidates leave undecided is
    drawn by the definition in a kernel too, so the program has no lax.cond (whose predicate XLA:GPU copies to
    the host: see Branches); with `fallback` given (tests), a batch with such a row takes it instead. Off GPUs the
    kernels are interpreted (tests only). maxima: the block_maxima of the logits drawn over, where the caller took
    them already. temperature [S]: x is unscaled, the logits drawn over x / temperature (divided as the kernels
    load them: no scaled copy)."""
    from ..kernels.gpu_sampler import draw

    S, V = x.shape
    nb = -(-V // BLOCK)
    scaled = x if temperature is None else x / temperature[:, None]  # written only where an XLA way reads it
    if nb <= BLOCKS:  # a small vocabulary: sorting it is the cheap way
        return _draw((fallback or filters_by_sort)(scaled, b), greedy, noise)
    tokens, decided = draw(
        x,
        block_maxima(scaled) if maxima is None else maxima,
        b.top_k,
        b.top_p,
        b.min_p,
        greedy,
        noise.keys,
        exact=fallback is None,
        interpret=jax.default_backend() != "gpu",
        temperature=temperature,
    )
    if fallback is None:  # the kernels decided every row (the undecided by the definition, in a kernel)
        return tokens
    return jax.lax.cond(jnp.all(decided), lambda: tokens, lambda: _draw(fallback(scaled, b), greedy, noise))


def block_candidates(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's candidates, sorted descending [S, BLOCKS * BLOCK], and t0: every value above t0 is among them."""
    S, V = x.shape
    nb = -(-V // BLOCK)
    blocks = jnp.pad(x, ((0, 0), (0, nb * BLOCK - V)), constant_values=-jnp.inf).reshape(S, nb, BLOCK)
    maxima, which = jax.lax.top_k(jnp.max(blocks, axis=-1), BLOCKS)
    c = jnp.take_along_axis(blocks, which[:, :, None], axis=1).reshape(S, BLOCKS * BLOCK)
    return -jnp.sort(-c, axis=-1), maxima[:, -1]


def mass_above(x: jax.Array, weights: jax.Array, values: jax.Array) -> jax.Array:
    """[S, D]: per row, the sum of weights over the values strictly above each of its D values (D row reductions)."""
    return jnp.sum(jnp.where(x[:, None, :] > values[:, :, None], weights[:, None, :], 0.0), axis=-1)


def first_max(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1): each row's first index of its largest value (of its first NaN, where it has one), by
    plain reductions. XLA:CPU runs argmax's (value, index) reduction unvectorized: 220 us for one row of 49,152
    logits, 1.8 ms for 16, against 39 and 485 us this way (tests/test_sampler.py checks the two agree, NaN and
    infinities included). Elsewhere jnp.argmax itself: a GPU fuses it into one pass, where this takes two or three."""
    if jax.default_backend() != "cpu":
        return jnp.argmax(x, axis=-1)
    nan = jnp.isnan(x)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == jnp.max(x, axis=-1, keepdims=True))
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, ids, x.shape[-1]), axis=-1)


def _draw(x: jax.Array, greedy: jax.Array, noise) -> jax.Array:
    """Greedy rows take the argmax, the rest the Gumbel-max draw over what their filters kept."""
    return jnp.where(greedy, first_max(x), first_max(x + noise()))


def _draw_kept(x: jax.Array, greedy: jax.Array, noise) -> jax.Array:
    """_draw's tokens after the filters: where every sampled row kept at most KEPT tokens, the noise is drawn at the
    KEPT largest values' ids only (noise is a function of the row's key and the id: the same tokens), not over the
    whole vocabulary (its threefry was ~1.2 ms of a CPU step's 3 ms sampler for the default model's 49,152 ids)."""
    if x.shape[1] <= KEPT:  # a vocabulary this small: the whole row's noise is as cheap
        return _draw(x, greedy, noise)
    sampled_kept = jnp.where(greedy, 0, jnp.sum(x > -jnp.inf, axis=-1))

    def few():
        ids = jax.lax.top_k(x, KEPT)[1]  # every kept token is among them, in order of value
        values = jnp.take_along_axis(x, ids, axis=-1)  # by id: XLA:CPU's TopK stays one (top_thresholds)
        perturbed = jnp.where(values > -jnp.inf, values + noise(ids), -jnp.inf)
        return jnp.take_along_axis(ids, jnp.argmax(perturbed, axis=-1)[:, None], axis=-1)[:, 0]

    drawn = jax.lax.cond(jnp.all(sampled_kept <= KEPT), few, lambda: first_max(x + noise()))
    return jnp.where(greedy, first_max(x), drawn)


def filters_by_sort(x: jax.Array, b: SamplingBatch[jax.Array]) -> jax.Array:
    """Top-k, top-p, min-p by one descending sort of the vocabulary: the definition, and the candidates' fallback."""
    S, V = x.shape
    ordered = jnp.sort(x, axis=-1)[:, ::-1]  # descending
    k = jnp.where(b.top_k > 0, jnp.minimum(b.top_k, V), V)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    ordered = jnp.where(jnp.arange(V)[None, :] < k[:, None], ordered, -jnp.inf)  # top-p renormalises after top-k
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    in_top_p = before < b.top_p[:, None]
    pth = jnp.min(jnp.where(in_top_p, ordered, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, pth)
    min_p_floor = ordered[:, :1] + jnp.log(jnp.maximum(b.min_p, 1e-30))[:, None]  # p >= min_p * p_max
    threshold = jnp.where(b.min_p[:, None] > 0, jnp.maximum(threshold, min_p_floor), threshold)
    return jnp.where(x >= threshold, x, -jnp.inf)


def search_passes(pivots: int) -> int:
    """Passes that pin one int32 key when each splits the open interval by `pivots` candidates."""
    span, passes = 1 << 32, 0
    while span > 1:
        span, passes = -(-span // (pivots + 1)), passes + 1
    return passes


def _search(keys: jax.Array, holds, pivots: int, smallest_false: bool = False) -> jax.Array:
    """Per row, over the int32 key range: the largest t where `holds(t)` (true up to a point, then false), or with
    smallest_false the smallest t where it no longer holds. Each pass asks holds([S, pivots] candidates evenly
    spread over (lo, hi)) and keeps the sub-interval where the answer turns; search_passes(pivots) pin one key."""
    lo = jnp.min(keys, axis=-1) - (1 if smallest_false else 0)  # holds(lo) is true (count >= k, mass >= p)
    hi = jnp.max(keys, axis=-1) + (0 if smallest_false else 1)  # holds(hi) is false
    j = jnp.arange(1, pivots + 1, dtype=jnp.uint32)

    def narrow(_, bounds):
        lo, hi = bounds
        span = jax.lax.bitcast_convert_type(hi - lo, jnp.uint32)[:, None]  # hi - lo, exact mod 2^32
        # lo + floor(span * j / (pivots + 1)) without overflowing 32 bits
        offset = (span // (pivots + 1)) * j + (span % (pivots + 1)) * j // (pivots + 1)
        t = lo[:, None] + jax.lax.bitcast_convert_type(offset, jnp.int32)  # [S, pivots], wraps back into range
        ok = holds(t)  # monotone in t: a run of true, then false
        n = jnp.sum(ok, axis=-1)
        below = jnp.take_along_axis(t, jnp.maximum(n - 1, 0)[:, None], axis=-1)[:, 0]
        above = jnp.take_along_axis(t, jnp.minimum(n, pivots - 1)[:, None], axis=-1)[:, 0]
        return jnp.where(n > 0, below, lo), jnp.where(n < pivots, above, hi)

    lo, hi = jax.lax.fori_loop(0, search_passes(pivots), narrow, (lo, hi))
    return hi if smallest_false else lo


# x, b -> x with what the filters drop at -inf
FILTERS: dict[str, Callable[[jax.Array, SamplingBatch[jax.Array]], jax.Array]] = {
    "sort": filters_by_sort,
    "bisection": filters_by_bisection,
    "top": filters_by_top,
    **{f"search{n}": functools.partial(filters_by_search, pivots=n) for n in (3, 7, 15, 31)},
}
# x, b, greedy, noise -> each row's token
DRAWS: dict[str, Callable[[jax.Array, SamplingBatch[jax.Array], jax.Array, RowNoise], jax.Array]] = {
    "candidates": draw_by_candidates,  # methods that filter as they draw
    "candidates-fused": functools.partial(draw_by_candidates, best=best_by_blocks),
    "candidates-kernel": functools.partial(draw_by_candidates, best=best_by_blocks, in_one_pass=True),
    "kernels": draw_by_kernels,
    "top": draw_by_top,  # FILTERS' "top" and _draw_kept's draw in one (the sampler's way where "top" is named)
}


def filters_name(backend: str) -> str:
    """All are exact. On GPUs gpu_sampler's kernels (the sampler alone, 256 x 128,256 on an H100: 0.69 ms on flat
    rows and 0.61 on peaked ones, against 1.35 and 1.41 for candidates-fused, XLA's candidates draw with the best
    perturbed values found by block maxima, and 3.6 for the sort), on CPUs (and TPUs, untested) "top": the kept
    set from each row's 64 largest values where they decide it, else the bisection (2.4x the sort on this
    repository's CPU benchmark): benchmarks/RESULTS.md. CAPSTAN_SAMPLING_FILTERS names another
    (benchmarks/sampler.py compares them)."""
    name = os.environ.get("CAPSTAN_SAMPLING_FILTERS") or ("kernels" if backend == "gpu" else "top")
    if name not in FILTERS and name not in DRAWS:
        raise ValueError(f"CAPSTAN_SAMPLING_FILTERS={name!r}: not one of {', '.join({**FILTERS, **DRAWS})}")
    return name


def top_logprobs(lp: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MAX_LOGPROBS most likely (logprob, id) per row; padded with -inf for vocabularies smaller than that."""
    k = min(MAX_LOGPROBS, lp.shape[-1])
    values, ids = jax.lax.top_k(lp, k)
    pad = [(0, 0)] * (lp.ndim - 1) + [(0, MAX_LOGPROBS - k)]
    return jnp.pad(values, pad, constant_values=-jnp.inf), jnp.pad(ids, pad)
