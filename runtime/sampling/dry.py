"""DRY ("Don't Repeat Yourself") sampling, as llama.cpp and koboldcpp define it: a token that would extend a repeat
of the context's last n tokens (n >= dry_allowed_length) loses multiplier * base^(n - allowed_length) of its logit.

n for a token t is the longest suffix of the context that occurred earlier, followed by t, within the last
dry_penalty_last_n tokens; a sequence breaker ends what a match may span (the suffix after the last breaker), and a
breaker token itself is never penalised. Breakers are strings: a token whose text contains one is a breaker
(llama.cpp also matches breakers that span several tokens; we do not). On the device the context is the last
DRY_WINDOW tokens and a match counts at most DRY_MAX_MATCH of them (limits.py): one fixed shape.

`dry_penalty_reference` is the definition in plain Python; `dry_penalty` is the jitted one, checked against it."""

from __future__ import annotations

import functools
import math
from typing import Generic

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..arrays import HostOrDevice
from ..limits import DRY_MAX_MATCH, DRY_WINDOW

FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: base^exponent is clamped below it, as llama.cpp does


class DryParams(eqx.Module, Generic[HostOrDevice]):
    multiplier: HostOrDevice  # [S] f32; 0 = off
    base: HostOrDevice  # [S] f32
    allowed_length: HostOrDevice  # [S] i32
    last_n: HostOrDevice  # [S] i32: -1 = the whole window
    breakers: HostOrDevice  # [S, ceil(V/32)] i32: bit j of word w marks token 32w + j a sequence breaker
    any_dry: HostOrDevice  # [] bool: some row has a multiplier (else nothing here is read)


def max_exponent(base: float) -> int:
    return int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0


def dry_penalty_reference(
    context: list[int],
    vocab: int,
    *,
    multiplier: float,
    base: float,
    allowed_length: int,
    last_n: int,
    breaker_ids: set[int],
    window: int = DRY_WINDOW,
    max_match: int = DRY_MAX_MATCH,
) -> np.ndarray:
    """[vocab] f32: what DRY subtracts from each token's logit after this context (prompt then output)."""
    penalty = np.zeros(vocab, np.float32)
    n = window if last_n < 0 else min(last_n, window)
    ctx = context[-n:] if n and multiplier else []
    if len(ctx) <= allowed_length:
        return penalty
    limit = 0  # tokens since the last breaker: what a match may span
    while limit < len(ctx) and ctx[-1 - limit] not in breaker_ids:
        limit += 1
    if limit < allowed_length:
        return penalty
    limit = min(limit, max_match)
    longest: dict[int, int] = {}  # follower token -> the longest repeat it would extend
    for j in range(len(ctx) - 1):  # an earlier occurrence ending at j, followed by ctx[j + 1]
        m = 0
        while m < limit and j - m >= 0 and ctx[j - m] == ctx[-1 - m]:
            m += 1
        if m >= allowed_length:
            longest[ctx[j + 1]] = max(longest.get(ctx[j + 1], 0), m)
    cap = max_exponent(base)
    for token, m in longest.items():
        if token not in breaker_ids:
            exponent = m - allowed_length
            if cap > 0:
                exponent = min(exponent, cap)
            penalty[token] = multiplier * base**exponent
    return penalty


def recent_tokens(history: jax.Array, vocab: int, window: int = DRY_WINDOW) -> jax.Array:
    """[S, window] i32: the last `window` tokens of each row's history (vocab = unused), vocab before its start."""
    S, H = history.shape
    length = jnp.sum(history != vocab, axis=-1)
    at = length[:, None] - window + jnp.arange(window)[None, :]
    taken = jnp.take_along_axis(history, jnp.clip(at, 0, H - 1), axis=-1)
    return jnp.where(at >= 0, taken, vocab)


def push_recent(recent: jax.Array, tokens: jax.Array) -> jax.Array:
    """The window after each row's sampled token [S] joined it."""
    return jnp.concatenate([recent[:, 1:], tokens[:, None].astype(recent.dtype)], axis=1)


def _bits(words: jax.Array, ids: jax.Array) -> jax.Array:
    """[S, n] bool: bit ids of each row's mask words [S, W] (ids past the mask read as unset)."""
    w = jnp.take_along_axis(words, jnp.clip(ids >> 5, 0, words.shape[1] - 1), axis=-1)
    return ((w >> (ids & 31)) & 1).astype(jnp.bool_) & (ids >> 5 < words.shape[1])


def dry_penalty(recent: jax.Array, d: DryParams[jax.Array], vocab: int) -> jax.Array:
    """[S, vocab] f32: what DRY subtracts from each row's logits, given its last tokens [S, W] (vocab = none)."""
    S, W = recent.shape
    idx = jnp.arange(W)[None, :]
    n = jnp.where(d.last_n < 0, W, jnp.minimum(d.last_n, W))
    valid = (recent < vocab) & (idx >= W - n[:, None]) & (d.multiplier[:, None] != 0)
    ctx = jnp.where(valid, recent, vocab)
    available = jnp.sum(valid, axis=-1)
    breaker = _bits(d.breakers, ctx) | ~valid
    limit = W - 1 - jnp.max(jnp.where(breaker, idx, -1), axis=-1)  # tokens since the last breaker
    on = (available > d.allowed_length) & (limit >= d.allowed_length)
    limit = jnp.minimum(limit, DRY_MAX_MATCH)

    # m[j]: how many tokens ending at j equal the context's last ones, up to the first that differs: one [S, W, L]
    # comparison and a reduction, no loop (XLA:GPU reads a while loop's predicate back to the host every iteration)
    L = DRY_MAX_MATCH
    k = jnp.arange(L)
    padded = jnp.pad(ctx, ((0, 0), (L, 0)), constant_values=vocab)
    earlier = jnp.take(padded, jnp.arange(W)[:, None] - k[None, :] + L, axis=1)  # [S, W, L]: ctx[j - k]
    suffix = jnp.take(padded, W - 1 - k + L, axis=1)  # [S, L]: ctx[W - 1 - k]
    same = (earlier == suffix[:, None, :]) & (earlier < vocab) & (k[None, None, :] < limit[:, None, None])
    same = jnp.concatenate([same, jnp.zeros((S, W, 1), jnp.bool_)], axis=-1)  # the first that differs: at most L
    m = jnp.where(idx < W - 1, jnp.argmin(same, axis=-1), 0).astype(jnp.int32)
    eligible = (m[:, :-1] >= d.allowed_length[:, None]) & valid[:, :-1] & on[:, None]
    rows = jnp.arange(S)[:, None]
    longest = (
        jnp.full((S, vocab), -1, jnp.int32).at[rows, ctx[:, 1:]].max(jnp.where(eligible, m[:, :-1], -1), mode="drop")
    )
    exponent = (longest - d.allowed_length[:, None]).astype(jnp.float32)
    cap = jnp.where(d.base > 1.000001, jnp.floor(FLOAT_MAX_LOG / jnp.log(jnp.maximum(d.base, 1.000001))), jnp.inf)
    exponent = jnp.minimum(exponent, cap[:, None])
    penalty = d.multiplier[:, None] * jnp.power(d.base[:, None], exponent)
    all_ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32)[None, :], (S, vocab))
    hit = (longest >= 0) & ~_bits(d.breakers, all_ids)
    return jnp.where(hit, jnp.minimum(penalty, 1e30), 0.0)  # finite: a row never becomes all -inf


class BreakerMasks:
    """Each set of sequence-breaker strings as a mask over the vocabulary (token texts read once, when first asked)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @functools.cached_property
    def texts(self) -> list[str]:
        n = min(self.vocab_size, self.tokenizer.vocab_size)
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one per engine, a few breaker sets
    def words(self, breakers: tuple[str, ...]) -> np.ndarray:
        """[ceil(V/32)] i32 mask words of the tokens whose text contains a breaker."""
        return pack_bits([i for i, text in enumerate(self.texts) if any(b in text for b in breakers)], self.vocab_size)


def pack_bits(ids: list[int], vocab: int) -> np.ndarray:
    """[ceil(vocab/32)] i32 words with bit j of word w set for each id 32w + j."""
    flags = np.zeros(32 * -(-vocab // 32), np.uint32)
    flags[ids] = 1
    return (flags.reshape(-1, 32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32).view(np.int32)
