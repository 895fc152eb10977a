"""The sampling programs of a free batch's decode scan (engine/multi_step.py) and of speculation's proposals and
verification (speculative/): which sampling Branches a batch compiles, decided on the host from its requests'
SamplingParams."""

from __future__ import annotations

from .sampler import Branches
from .sampling_params import SamplingParams

# the scan never sees grammars (the pipeline takes them) or min_tokens bans (the multi-step plan refuses them); on CPUs
# one program takes every sampled run, penalties or not (a cond costs them nothing), carrying the penalties' counts
SCAN_BRANCHES = Branches(
    plain_greedy=None, any_constrained=False, any_penalty=None, any_filter=None, all_greedy=None, want_logprobs=None
)
# On GPUs every branch of a run is decided on the host: XLA:GPU copies each lax.cond's predicate to the host, and
# the device idles until the host has queued the kernels after it (H100, Llama-3.2-1B shape, 256 rows: a greedy
# dispatch of 16 steps 80 -> 67 ms without its two). A plain greedy run (the argmax of the raw logits) has a program
# of its own; sampled runs filter always (exact for rows without filters: the candidates' draw decides them
# without a fallback), with or without logprobs, with or without penalties. CPUs keep one program for sampled runs (a
# cond costs them nothing).
GREEDY_SCAN = Branches(
    plain_greedy=True, any_constrained=False, any_penalty=False, any_filter=False, all_greedy=True, want_logprobs=False
)
SAMPLED_SCANS = {
    w: Branches(
        plain_greedy=False, any_constrained=False, any_penalty=False, any_filter=True, all_greedy=False, want_logprobs=w
    )
    for w in (False, True)
}
PENALTY_SCANS = {w: b._replace(any_penalty=True, any_dry=False) for w, b in SAMPLED_SCANS.items()}
DRY_SCANS = {w: b._replace(any_dry=True) for w, b in PENALTY_SCANS.items()}  # (DRY is decided on the host too)
# an asynchronous single step's programs (engine.py): its rows ask for no DRY or grammars, so each branch is decided
# on the host and the step's call returns at once (plain greedy batches: the argmax; a batch with penalties reads its
# unread tokens into the rows' histories on the device, engine/step.py; with logprobs, the settled step reads them)
ASYNC_GREEDY = GREEDY_SCAN
ASYNC_SAMPLED, ASYNC_PENALIZED = SAMPLED_SCANS, PENALTY_SCANS  # by whether a row asked for logprobs
ASYNC_BRANCHES = (ASYNC_GREEDY, *ASYNC_SAMPLED.values(), *ASYNC_PENALIZED.values())


def scans(backend: str) -> tuple[Branches, ...]:
    """The decode scan's programs on this backend (each compiled at warm-up, once per row bucket)."""
    if backend == "gpu":
        return (GREEDY_SCAN, *SAMPLED_SCANS.values(), *PENALTY_SCANS.values(), *DRY_SCANS.values())
    return (GREEDY_SCAN, SCAN_BRANCHES)


def scan_branches(params: list[SamplingParams], backend: str) -> Branches:
    """The program for a free batch of these requests (the multi-step plan has refused min_tokens bans)."""
    penalties = any(p.uses_penalties for p in params)
    if not penalties and all(p.temperature == 0.0 and not p.logit_bias and p.logprobs is None for p in params):
        return GREEDY_SCAN
    if backend != "gpu":
        return SCAN_BRANCHES
    scans = (DRY_SCANS if any(p.uses_dry for p in params) else PENALTY_SCANS) if penalties else SAMPLED_SCANS
    return scans[any(p.logprobs is not None for p in params)]


def carries_counts(branches: Branches) -> bool:
    """Whether a decode scan with these branches takes and returns the penalties' counts (sampler.PenaltyCounts)."""
    return branches.any_penalty is not False
