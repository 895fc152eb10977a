"""Deleting an InferenceService while its resync runs: the object goes within seconds, not kopf's default minute.

kopf keeps its finalizer on a deleted object until the object's timers have exited, and when the resync timer is
still running its handler, kopf by default looks again only 60 s later (settings.background.cancellation_polling).
Here the resync is caught mid-run: the operator reads its pods' /metrics from a server on 127.0.0.1 that answers
after a delay (a slow pod; the operator's test-only --test-pod-addresses), and the deletion is sent while the
operator waits on it."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from control_plane import wait_for
from test_cluster_e2e import isvc_manifest

pytestmark = pytest.mark.cluster
ANSWER_AFTER_S = 3.0  # how long the slow pod takes to answer /metrics (the operator gives up at 2 s)


class SlowPod:
    """An HTTP server on 127.0.0.1 whose /metrics answers after ANSWER_AFTER_S; `asked` is set on each request."""

    def __init__(self):
        asked = self.asked = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                asked.set()
                time.sleep(ANSWER_AFTER_S)
                body = b"capstan_requests_running 0\n"
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the operator gave up waiting

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> SlowPod:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slow_pod():
    with SlowPod() as pod:
        yield pod


@pytest.fixture
def operator_reading_slow_pod(operator, slow_pod):
    with operator.reading_pods_at(slow_pod.address):
        yield operator


def test_a_service_deleted_during_its_resync_goes_within_seconds(
    cluster, operator_reading_slow_pod, slow_pod, namespace
):
    manifest = isvc_manifest(
        "slow",
        model={"uri": "hf://capstan/tiny"},
        minReplicas=1,
        maxReplicas=2,
        autoscaling={"metric": "concurrentRequests", "target": 3},
    )
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
    wait_for(
        "a ready replica",
        lambda: cluster.get_json("deployment", "slow", "-n", namespace).get("status", {}).get("readyReplicas") == 1,
        timeout=90,
        interval=0.5,
    )
    # The next resync to read the pod is the one the deletion lands in.
    slow_pod.asked.clear()
    assert slow_pod.asked.wait(timeout=60), "the resync never read the pod's /metrics"
    started = time.monotonic()
    cluster.kubectl("delete", "csvc", "slow", "-n", namespace, "--wait=true", "--timeout=90s", timeout=120)
    took = time.monotonic() - started
    print(f"deleted in {took:.1f} s")  # pytest -s: 62.1 s with kopf's default polling, ~3 s now
    assert took < 20, f"the deletion took {took:.1f} s"
