"""Autoscaling end to end: real `capstan serve` processes on 127.0.0.1 stand in for the fake pods'
servers (the operator's test-only --test-pod-addresses), load is sent to them, and replicas follow."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml
from control_plane import free_port, stop_process_group, wait_for

from capstan.runtime.config import DEFAULT_MODEL  # pinned: the tiny model, not SmolLM2 (speed)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
CLIENTS_PER_SERVER = 8  # with --max-num-seqs 2: 2 running + about 6 waiting on each server


class ServeProcess:
    """One `capstan serve` of the embedded tiny model."""

    def __init__(self, log: Path):
        self.port = free_port()
        self.log = log
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "capstan.runtime.cli",
                "serve",
                str(DEFAULT_MODEL),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--served-model-name",
                "tiny",
                "--max-num-seqs",
                "2",
                "--drain-timeout",
                "1",
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ready(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()[-3000:]
        with urllib.request.urlopen(f"http://{self.address}/ready", timeout=2) as response:
            return response.status == 200

    def stop(self) -> None:
        stop_process_group(self.process, timeout=30)


class Load:
    """Clients that keep sending completions until stopped."""

    def __init__(self, addresses: list[str]):
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(a,), daemon=True)
            for a in addresses
            for _ in range(CLIENTS_PER_SERVER)
        ]
        self.completed = 0

    def _client(self, address: str) -> None:
        with httpx.Client(base_url=f"http://{address}", timeout=120) as client:
            while not self.stopping.is_set():
                response = client.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 1.0},
                )
                response.raise_for_status()
                self.completed += 1

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)


@pytest.fixture
def servers(tmp_path):
    started = [ServeProcess(tmp_path / f"serve-{i}.log") for i in range(2)]
    try:
        for server in started:
            wait_for("capstan serve ready", server.ready, timeout=300, interval=1, process_log=server.log)
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def operator_reading_servers(operator, servers):
    with operator.reading_pods_at(*(s.address for s in servers)):
        yield operator


def test_replicas_follow_load(cluster, operator_reading_servers, servers, namespace):
    manifest = {
        "apiVersion": "serving.capstan.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"uri": "hf://capstan/tiny"},
            "minReplicas": 1,
            "maxReplicas": 4,
            "autoscaling": {
                "metric": "concurrentRequests",
                "target": 3,
                "scaleUpStabilizationSeconds": 0,
                "scaleDownStabilizationSeconds": 10,
            },
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def isvc():
        return cluster.get_json("inferenceservice", "tiny", "-n", namespace)

    def replicas_are(check):
        def probe():
            current = isvc()
            status = current.get("status", {})
            deployment = cluster.get_json("deployment", "tiny", "-n", namespace)
            desired = status.get("desiredReplicas")
            return (
                check(desired)
                and deployment["spec"]["replicas"] == desired
                and status.get("readyReplicas") == desired
                and current
            )

        return probe

    wait_for("one idle replica", replicas_are(lambda n: n == 1), timeout=90, interval=1)

    with Load([s.address for s in servers]) as load:
        scaled_up = wait_for(
            "scale up under load", replicas_are(lambda n: n is not None and n >= 3), timeout=120, interval=1
        )
        assert scaled_up["status"]["autoscaling"]["lastDecision"].startswith("scale up")
    assert load.completed > 0

    scaled_down = wait_for("scale down after the load stops", replicas_are(lambda n: n == 1), timeout=120, interval=1)
    assert scaled_down["status"]["autoscaling"]["lastDecision"].startswith("scale down")
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=Scaled").stdout
    assert "scale up" in events and "scale down" in events
