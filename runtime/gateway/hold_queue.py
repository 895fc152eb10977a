"""Requests for a model with no ready replica wait here (scale from zero, or every replica restarting), up to a
bound on how many and for how long; then they get 503 with Retry-After, as a full server's queue does."""

from __future__ import annotations

from dataclasses import dataclass

from ..server.error_body import APIError
from .gateway_flags import DEFAULT_HOLD_TIMEOUT_SECONDS, DEFAULT_MAX_HELD
from .replica_pool import ReplicaPool


@dataclass
class HoldQueue:
    pool: ReplicaPool
    max_held: int = DEFAULT_MAX_HELD
    timeout: float = DEFAULT_HOLD_TIMEOUT_SECONDS
    held: int = 0
    refused: int = 0  # full queue or timed out, since start

    async def wait_for_replica(self, model: str) -> None:
        """Return once a replica of `model` is ready; raise a 503 APIError when the queue is full or time runs out."""
        if self.pool.ready_for(model):
            return
        if self.held >= self.max_held:
            self.refused += 1
            raise APIError(
                503,
                f"no replica of `{model}` is ready and {self.held} requests already wait for one; retry later",
                code="no_replica",
                headers={"Retry-After": "5"},
            )
        self.held += 1
        try:
            ready = await self.pool.wait_ready(model, self.timeout)
        finally:
            self.held -= 1
        if not ready:
            self.refused += 1
            raise APIError(
                503,
                f"no replica of `{model}` became ready within {self.timeout:g} s (scaling from zero "
                "or restarting); retry later",
                code="no_replica",
                headers={"Retry-After": "10"},
            )
