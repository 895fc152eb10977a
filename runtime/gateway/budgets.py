"""Per-client budgets: requests and tokens per window (a fixed window, one minute unless the flag says otherwise)
and requests open at once.

A request is admitted only when all of it fits: one more request in the window, a free concurrency slot, and its
worst case in tokens (request_cost.py: its prompt plus every choice's max_tokens) besides what the window has
charged and what requests still running have reserved. That worst case is reserved at admission and settled when
the request ends: the reservation is replaced by the tokens it used. So a burst of concurrent requests cannot take
a window past its budget: the charged total of a window never exceeds it. A request is charged to the window that
admitted it, even when it ends in the next one.

Several gateway replicas: each enforces `1/shares` of every budget (`--budget-shares`, the chart sets it to the
replica count), so together they never admit more than the budget; a client whose requests the Service spreads
unevenly over the replicas may be refused before it has spent its whole budget. One replica (shares 1) is exact.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .client_keys import ClientKey

DEFAULT_WINDOW_SECONDS = 60.0
CONCURRENCY_RETRY_SECONDS = 1.0  # a slot frees when any open request ends: try again soon


@dataclass
class Refusal:
    reason: str  # requests, tokens, concurrency
    message: str
    retry_after: float


@dataclass
class Reservation:
    """An admitted request's hold on its client's budget; `Budgets.settle` ends it, once."""

    client: str
    window: int
    tokens: int
    settled: bool = False


@dataclass
class _Usage:
    window: int = -1  # the window these counts belong to
    requests: int = 0
    tokens: int = 0  # charged: requests of this window that ended
    reserved: int = 0  # the worst cases of requests of this window still running
    open: int = 0


class Budgets:
    def __init__(self, window_seconds: float = DEFAULT_WINDOW_SECONDS, shares: int = 1, clock=time.time):
        if window_seconds <= 0 or shares < 1:
            raise ValueError("--budget-window must be above 0 and --budget-shares at least 1")
        self.window_seconds, self.shares, self.clock = window_seconds, shares, clock
        self._usage: dict[str, _Usage] = {}

    def limits(self, client: ClientKey) -> tuple[int | None, int | None, int | None]:
        """This replica's share of (requests per window, tokens per window, concurrency)."""
        scale = self.window_seconds / 60.0 / self.shares

        def per_window(per_minute: int | None) -> int | None:
            return None if per_minute is None else max(1, math.floor(per_minute * scale))

        concurrency = None if client.max_concurrent is None else max(1, client.max_concurrent // self.shares)
        return per_window(client.requests_per_minute), per_window(client.tokens_per_minute), concurrency

    def _current(self, name: str) -> tuple[_Usage, float]:
        now = self.clock()
        window = int(now // self.window_seconds)
        usage = self._usage.setdefault(name, _Usage())
        if usage.window != window:  # open requests stay open; what they reserved belongs to the window they left
            usage.window, usage.requests, usage.tokens, usage.reserved = window, 0, 0, 0
        return usage, (window + 1) * self.window_seconds - now

    def refusal(self, client: ClientKey, tokens: int = 0) -> Refusal | None:
        """Why a request that may cost up to `tokens` would be refused now (and when to retry), or None."""
        usage, reset = self._current(client.name)
        requests, budget, concurrency = self.limits(client)
        window = f"this {self.window_seconds:g} s window"
        if requests is not None and usage.requests >= requests:
            return Refusal("requests", f"client {client.name!r} used its {requests} requests of {window}", reset)
        if budget is not None and tokens > budget:
            return Refusal(
                "tokens",
                f"this request may use up to {tokens} tokens (its prompt plus max_tokens for each choice), more "
                f"than client {client.name!r}'s whole budget of {budget} tokens a window; lower max_tokens",
                reset,
            )
        if budget is not None and usage.tokens + usage.reserved + tokens > budget:
            return Refusal(
                "tokens",
                f"client {client.name!r} has {usage.tokens} of its {budget} tokens of {window} used and "
                f"{usage.reserved} reserved by requests running; this one may use up to {tokens}",
                reset,
            )
        if concurrency is not None and usage.open >= concurrency:
            return Refusal(
                "concurrency",
                f"client {client.name!r} has {usage.open} requests open, its limit",
                CONCURRENCY_RETRY_SECONDS,
            )
        return None

    def admit(self, client: ClientKey, tokens: int = 0) -> Reservation | Refusal:
        """Take one request, one concurrency slot and `tokens` (the request's worst case), or say why not."""
        refusal = self.refusal(client, tokens)
        if refusal is not None:
            return refusal
        usage, _ = self._current(client.name)
        usage.requests += 1
        usage.open += 1
        usage.reserved += tokens
        return Reservation(client.name, usage.window, tokens)

    def settle(self, reservation: Reservation, tokens: int) -> None:
        """The request is done: free its slot, and charge the tokens it used in place of what it reserved."""
        assert not reservation.settled, "a reservation is settled once"
        reservation.settled = True
        usage, _ = self._current(reservation.client)
        usage.open -= 1
        if usage.window == reservation.window:  # else its window is over, and what it used counted there
            usage.reserved -= reservation.tokens
            usage.tokens += tokens

    def headers(self, client: ClientKey) -> dict[str, str]:
        """OpenAI's rate-limit headers for this client now (only for the budgets it has); reserved tokens count as
        used until their requests end."""
        usage, reset = self._current(client.name)
        requests, tokens, _ = self.limits(client)
        headers = {}
        used = (("requests", requests, usage.requests), ("tokens", tokens, usage.tokens + usage.reserved))
        for kind, limit, spent in used:
            if limit is not None:
                headers[f"x-ratelimit-limit-{kind}"] = str(limit)
                headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - spent))
                headers[f"x-ratelimit-reset-{kind}"] = f"{reset:.3f}s"
        return headers

    def charged(self, client: ClientKey) -> int:
        """Tokens charged to this client in the current window (requests that ended)."""
        return self._current(client.name)[0].tokens
