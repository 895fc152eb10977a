"""Graceful removal with real pods: 64 streaming clients through the Service while the spec rolls the pods,
then while replicas go 2 -> 1. No request may fail and every stream must end with a finish_reason: the
preStop delay keeps each old server serving until kube-proxy has stopped sending it new connections, and the
server's drain finishes what it holds. The timeline of each removal is printed (pytest -s shows it)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from control_plane import wait_for
from drain_timeline import DrainTimeline
from streaming_load import StreamingLoad
from test_real_pods_e2e import pods_of, tiny_inference_service, wait_serving

pytestmark = [pytest.mark.realnode, pytest.mark.slow, pytest.mark.timeout(1200)]
CLIENTS = 64
DRAIN_TIMEOUT = 20  # seconds; a 16-token stream takes far less, even with 64 clients on two cores


@pytest.fixture
def served(real_cluster, chart, compile_cache):
    """Two ready replicas of the tiny model behind their Service, in a namespace of their own."""
    namespace = f"rollout-{uuid.uuid4().hex[:6]}"
    real_cluster.kubectl("create", "namespace", namespace)
    wait_for(
        "the namespace's default service account",
        lambda: real_cluster.kubectl("get", "sa", "default", "-n", namespace, check=False).returncode == 0,
        60,
    )
    real_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=tiny(compile_cache))
    wait_serving(real_cluster, namespace, "tiny", replicas=2)
    cluster_ip = real_cluster.get_json("service", "tiny", "-n", namespace)["spec"]["clusterIP"]
    yield namespace, f"http://{cluster_ip}/v1", compile_cache
    real_cluster.kubectl("delete", "namespace", namespace, "--wait=true", check=False, timeout=180)


def tiny(compile_cache, *extra_args: str) -> str:
    return tiny_inference_service(
        "tiny",
        compile_cache,
        replicas=2,
        drainTimeoutSeconds=DRAIN_TIMEOUT,
        extra_args=("--max-num-seqs", "64", *extra_args),
    )


def _under_load(
    real_node, namespace: str, base_url: str, change, settled, removed: int
) -> tuple[StreamingLoad, DrainTimeline]:
    cluster = real_node.cluster
    old_pods = pods_of(cluster, namespace, "tiny")
    with StreamingLoad(base_url, clients=CLIENTS) as load:
        wait_for("every client streaming", lambda: load.completed_since(0) >= CLIENTS, 120, interval=0.5)
        with DrainTimeline(cluster, real_node, namespace, old_pods) as timeline:
            change()
            wait_for("the change to settle", settled, 600, interval=1)
            # the last old pod is deleted as the change settles: its grace period (preStop, drain, margin: 35 s),
            # then the kubelet's teardown, which took over 80 s once with 64 clients and two new pods on two cores
            try:
                wait_for(
                    f"{removed} old pods gone",
                    lambda: sum(1 for r in timeline.pods.values() if r.gone) >= removed,
                    DRAIN_TIMEOUT + 160,
                    interval=1,
                )
            except TimeoutError as e:  # say where each removal stood
                raise TimeoutError(f"{e}\n" + "\n".join(r.summary() for r in timeline.pods.values())) from e
        after = time.monotonic()
        wait_for("requests served after the change", lambda: load.completed_since(after) >= CLIENTS, 120)
    for removal in timeline.pods.values():
        print(removal.summary())
    print(f"{len(load.results)} streams, {len(load.failures)} failed")
    return load, timeline


def _assert_graceful(load: StreamingLoad, timeline: DrainTimeline, removed: int) -> None:
    assert not load.failures, json.dumps([f.error for f in load.failures[:10]], indent=1)
    assert all(r.finish_reason in ("length", "stop") for r in load.results)
    removals = [r for r in timeline.pods.values() if r.deleted]
    assert len(removals) == removed, [r.summary() for r in timeline.pods.values()]
    for removal in removals:
        # The server stops taking requests only after kube-proxy stopped sending it any.
        assert removal.proxy_rule_removed and removal.sigterm, removal.summary() + "\n" + "\n".join(removal.log[-20:])
        assert removal.proxy_rule_removed < removal.sigterm, removal.summary()
        assert removal.drained and removal.drained - removal.sigterm < DRAIN_TIMEOUT, removal.summary()


def test_a_rolling_update_under_load_fails_no_request(real_node, served):
    namespace, base_url, compile_cache = served
    cluster = real_node.cluster
    generation = cluster.get_json("deployment", "tiny", "-n", namespace)["metadata"]["generation"]

    def change():  # a new argument: a new pod template, so the Deployment rolls
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=tiny(compile_cache, "--log-level", "info"))

    def rolled():
        # the Deployment's own generation, not the InferenceService's: until the operator has applied the new
        # template, the old Deployment reads "2 updated, 2 ready" (once in CI the wait ended within ~14 s, before
        # any new pod could start, and the last old pod was not gone 180 s later)
        deployment = cluster.get_json("deployment", "tiny", "-n", namespace)
        status = deployment["status"]
        return (
            deployment["metadata"]["generation"] > generation
            and status.get("observedGeneration") == deployment["metadata"]["generation"]
            and status.get("updatedReplicas") == status.get("readyReplicas") == 2
            and status.get("replicas") == 2
        )

    load, timeline = _under_load(real_node, namespace, base_url, change, rolled, removed=2)
    _assert_graceful(load, timeline, removed=2)


def test_a_scale_down_under_load_fails_no_request(real_node, served):
    namespace, base_url, _ = served
    cluster = real_node.cluster

    def change():
        cluster.kubectl("scale", "inferenceservice/tiny", "-n", namespace, "--replicas=1")

    def scaled():
        return len([p for p in pods_of(cluster, namespace, "tiny") if not p["metadata"].get("deletionTimestamp")]) == 1

    load, timeline = _under_load(real_node, namespace, base_url, change, scaled, removed=1)
    _assert_graceful(load, timeline, removed=1)
