"""Which engine core a frontend sends its next request to (--data-parallel-size): the one holding the fewest of this
frontend's open requests (least outstanding requests); ties go to the core whose last stats showed fewer running and
waiting requests, then to a core that depends on the frontend, so that frontends with one request each do not all
choose core 0.

Every frontend balances its own requests, so the cores' loads, sums of balanced parts, differ by at most about one
request per frontend, however late the cores' stats come. Choosing by the stats plus "sent since the last stats"
did not: a core busy in a long step reads its socket late, so every frontend saw only its own share of what waited
there and sent that core more (of a burst of 2,048 requests from 16 frontends one core of two got at least 1,286:
6 were answered queue_full past its 1,280; GPUs busy 63% and 37%; benchmarks/RESULTS.md). A core that serves slower keeps its requests open longer, so it
is given fewer."""

from __future__ import annotations

from .engine_stats import EngineStats


class CoreLoads:
    def __init__(self, cores: int, no_stats: EngineStats, frontend: int = 0):
        self.stats = [no_stats] * cores  # each core's last stats (the server's gauges add them up)
        self._open = [0] * cores  # this frontend's open requests on each core
        self._core_of: dict[str, int] = {}
        self._frontend = frontend

    def pick(self, request_id: str) -> int:
        """The core for a new request, which counts as open there until done(request_id)."""
        cores = len(self._open)
        core = min(
            range(cores),
            key=lambda c: (self._open[c], self.stats[c].running + self.stats[c].waiting, (c - self._frontend) % cores),
        )
        self._open[core] += 1
        self._core_of[request_id] = core
        return core

    def core_of(self, request_id: str) -> int | None:
        return self._core_of.get(request_id)

    def done(self, request_id: str) -> None:
        """The request finished, failed or was aborted (a second call is harmless)."""
        core = self._core_of.pop(request_id, None)
        if core is not None:
            self._open[core] -= 1

    def open(self, core: int) -> int:
        return self._open[core]
