"""Per-client budgets: requests and tokens per window (a fixed window, one minute unless the flag says otherwise)
and requests open at once.

A request is admitted while its client has requests and tokens left in the window and a free concurrency slot;
its tokens (prompt + completion, from the replica's `usage`) are charged when it finishes, so the one request that
spends the last tokens may take the window past its budget by its own size, and the next one is refused.

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


@dataclass
class Refusal:
    reason: str  # requests, tokens, concurrency
    message: str
    retry_after: float


@dataclass
class _Usage:
    window: int = -1  # the window these counts belong to
    requests: int = 0
    tokens: int = 0
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

    def _current(self, client: ClientKey) -> tuple[_Usage, float]:
        now = self.clock()
        window = int(now // self.window_seconds)
        usage = self._usage.setdefault(client.name, _Usage())
        if usage.window != window:
            usage.window, usage.requests, usage.tokens = window, 0, 0
        return usage, (window + 1) * self.window_seconds - now

    def admit(self, client: ClientKey) -> Refusal | None:
        """Take one request and one concurrency slot, or say why not and when to retry."""
        usage, reset = self._current(client)
        requests, tokens, concurrency = self.limits(client)
        if requests is not None and usage.requests >= requests:
            return Refusal(
                "requests",
                f"client {client.name!r} used its {requests} requests of this {self.window_seconds:g} s window",
                reset,
            )
        if tokens is not None and usage.tokens >= tokens:
            return Refusal(
                "tokens",
                f"client {client.name!r} used its {tokens} tokens of this {self.window_seconds:g} s window",
                reset,
            )
        if concurrency is not None and usage.open >= concurrency:
            return Refusal("concurrency", f"client {client.name!r} has {usage.open} requests open, its limit", 1.0)
        usage.requests += 1
        usage.open += 1
        return None

    def finish(self, client: ClientKey, tokens: int) -> None:
        """The request is done: free its slot and charge its tokens to the current window."""
        usage, _ = self._current(client)
        usage.open -= 1
        usage.tokens += tokens

    def headers(self, client: ClientKey) -> dict[str, str]:
        """OpenAI's rate-limit headers for this client now (only for the budgets it has)."""
        usage, reset = self._current(client)
        requests, tokens, _ = self.limits(client)
        headers = {}
        for kind, limit, used in (("requests", requests, usage.requests), ("tokens", tokens, usage.tokens)):
            if limit is not None:
                headers[f"x-ratelimit-limit-{kind}"] = str(limit)
                headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - used))
                headers[f"x-ratelimit-reset-{kind}"] = f"{reset:.3f}s"
        return headers
