"""The frontends' choice of engine core under --data-parallel-size (runtime/engine/core_loads.py): a burst of requests
from many frontends spreads evenly over the cores however late the cores read their sockets and send their stats,
light load spreads too, and a core that serves slower is given fewer."""

from __future__ import annotations

import dataclasses
import random

from capstan.runtime.engine.core_client import NO_STATS
from capstan.runtime.engine.core_loads import CoreLoads


def _stats(running: int, waiting: int):
    return dataclasses.replace(NO_STATS, running=running, waiting=waiting)


def test_open_requests_decide_and_finished_ones_leave():
    loads = CoreLoads(2, NO_STATS)
    assert [loads.pick(f"r{i}") for i in range(4)] == [0, 1, 0, 1]
    loads.done("r1")
    loads.done("r1")  # a second report (an abort after the finish) changes nothing
    assert (loads.open(0), loads.open(1)) == (2, 1)
    assert loads.pick("r4") == 1 and loads.core_of("r4") == 1
    loads.done("unknown")
    assert loads.core_of("r1") is None


def test_ties_follow_the_stats_then_spread_over_frontends():
    first = [CoreLoads(2, NO_STATS, frontend=f).pick("a") for f in range(4)]
    assert first == [0, 1, 0, 1]  # one request from each of four frontends: both cores
    loads = CoreLoads(2, NO_STATS, frontend=0)
    loads.stats[0] = _stats(5, 3)
    assert loads.pick("a") == 1  # the other frontends' requests on core 0


def _burst(read_chance: tuple[float, ...], seed: int, frontends: int = 12, burst: int = 2048) -> list[int]:
    """A burst of requests over the frontends in turn; each core now and then reads part of its socket and sends
    every frontend its stats. Returns the requests each core got."""
    rng = random.Random(seed)
    cores = len(read_chance)
    views = [CoreLoads(cores, NO_STATS, f) for f in range(frontends)]
    unread, held = [0] * cores, [0] * cores
    for i in range(burst):
        unread[views[i % frontends].pick(f"r{i}")] += 1
        for c in range(cores):
            if rng.random() < read_chance[c]:
                k = rng.randint(0, unread[c])
                unread[c], held[c] = unread[c] - k, held[c] + k
                for view in views:
                    view.stats[c] = _stats(min(held[c], 256), max(0, held[c] - 256))
    return [held[c] + unread[c] for c in range(cores)]


def test_a_burst_splits_evenly_however_late_the_cores_read_it():
    for chance in ((0.05, 0.05), (0.9, 0.01), (0.01, 0.9), (0.5, 0.02, 0.2, 0.0)):
        for seed in range(3):
            totals = _burst(chance, seed)
            assert sum(totals) == 2048 and max(totals) - min(totals) <= 12, (chance, totals)


def test_a_slower_core_is_given_fewer():
    loads = CoreLoads(2, NO_STATS)
    given: list[list[str]] = [[], []]  # each core's requests, oldest first, while open
    counts = [0, 0]
    for i in range(999):  # core 0 finishes its oldest open request every turn, core 1 every third turn
        core = loads.pick(f"r{i}")
        given[core].append(f"r{i}")
        counts[core] += 1
        for c in (0, 1):
            if given[c] and (c == 0 or i % 3 == 2):
                loads.done(given[c].pop(0))
    assert counts[0] > 2 * counts[1], counts
