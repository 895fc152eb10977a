"""The autoscaling policy on metric series: steady load holds, bursts scale up at once and down only
after the stabilisation window, noise does not make replicas flap."""

import itertools
import random

from capstan.operator.api import AutoscalingSpec
from capstan.operator.autoscaler import PodLoad, decide

STEP = 15.0  # seconds between evaluations


def simulate(policy, series, bounds=(1, 10), start=1):
    """Feed total in-flight requests per evaluation; pods share the load evenly. Returns replicas per step."""
    replicas, history, out = start, [], []
    for i, total in enumerate(series):
        loads = [PodLoad(running=total / replicas, waiting=0.0, kv_cache_usage=0.0)] * replicas
        decision = decide(policy, bounds, replicas, loads, history, now=1000.0 + i * STEP)
        replicas, history = decision.replicas, decision.recommendations
        out.append(replicas)
    return out


POLICY = AutoscalingSpec(target=8, scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=300)


def test_steady_load_settles_and_stays():
    replicas = simulate(POLICY, [24] * 60)
    assert replicas[0] == 3
    assert set(replicas) == {3}


def test_burst_scales_up_at_once_and_down_only_after_the_window():
    series = [8] * 4 + [64] * 4 + [8] * 40
    replicas = simulate(POLICY, series)
    assert replicas[3] == 1
    assert replicas[4] == 5  # 1 -> at most +4 in one decision
    assert replicas[5] == 8
    down_steps = 300 / STEP
    first_down = next(i for i in range(8, len(replicas)) if replicas[i] < 8)
    assert first_down - 7 >= down_steps  # held for the whole scale-down window after the last high sample
    assert replicas[-1] == 1


def test_noisy_load_around_the_target_does_not_flap():
    rng = random.Random(5)
    series = [max(0.0, rng.gauss(32, 3)) for _ in range(240)]  # one hour of noise around 4 replicas' worth
    replicas = simulate(POLICY, series, start=4)
    changes = sum(1 for a, b in itertools.pairwise(replicas) if a != b)
    assert changes <= 3, replicas
    assert all(4 <= r <= 6 for r in replicas)


def test_bounds_hold():
    assert max(simulate(POLICY, [1000] * 10, bounds=(2, 5), start=2)) == 5
    assert min(simulate(POLICY, [0] * 100, bounds=(2, 5), start=5)) == 2


def test_scale_up_window_ignores_short_spikes():
    patient = AutoscalingSpec(target=8, scale_up_stabilization_seconds=60, scale_down_stabilization_seconds=300)
    spike = simulate(patient, [8, 8, 64, 8, 8, 8])
    assert set(spike) == {1}
    sustained = simulate(patient, [8, 64, 64, 64, 64, 64, 64])
    assert sustained[-1] > 1 and sustained[3] == 1


def test_kv_cache_metric():
    policy = AutoscalingSpec(metric="kvCacheUsage", target=0.5)
    loads = [PodLoad(running=1, waiting=0, kv_cache_usage=0.9)] * 2
    assert decide(policy, (1, 10), 2, loads, [], now=0).replicas == 4


def test_no_metrics_keeps_replicas_and_history_survives_a_restart():
    first = decide(POLICY, (1, 10), 3, [], [], now=0)
    assert first.replicas == 3 and "no pod reported" in first.reason
    high = decide(POLICY, (1, 10), 3, [PodLoad(16, 8, 0)] * 3, first.recommendations, now=15)
    # A new operator process receives the recommendations from status and keeps the window.
    low = decide(POLICY, (1, 10), high.replicas, [PodLoad(0, 0, 0)] * high.replicas, high.recommendations, now=30)
    assert low.replicas == high.replicas == 7  # +4 at most per decision


def test_scale_from_zero_on_demand_and_back_to_zero_when_idle():
    """minReplicas 0: the gateway's last-request stamp lifts the floor to 1 until the idle period passes."""
    from capstan.operator.autoscaler import demand_floor

    policy = AutoscalingSpec(target=8, scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=60)
    assert demand_floor(policy, 0, None, now=1000.0) == 0  # never asked for: stays at zero
    assert demand_floor(policy, 2, 999.0, now=1000.0) == 2  # minReplicas above 0: the stamp changes nothing
    replicas, history = 0, []
    out = []
    for i in range(12):  # a request at t=1000 (held at the gateway, no pod yet), then silence; one step per 15 s
        now = 1000.0 + i * STEP
        floor = demand_floor(policy, 0, 1000.0, now)
        loads = [PodLoad(running=0.0, waiting=0.0, kv_cache_usage=0.0)] * replicas
        decision = decide(policy, (0, 4), replicas, loads, history, now=now, floor=floor)
        if i == 0:
            assert decision.reason.startswith("scale up 0 -> 1") and "scale from zero" in decision.reason
        replicas, history = decision.replicas, decision.recommendations
        out.append(replicas)
    assert out[:4] == [1, 1, 1, 1]  # kept while within the 60 s idle period
    assert out[-1] == 0 and out.index(0) == 4  # zero once the idle period has passed, not later
