"""An InferencePool (GIE v1) and its pods -> the endpoints the picker picks among. Pure: the objects as the
Kubernetes API returns them."""

from __future__ import annotations

import pytest

from capstan.runtime.gateway.discovery import Target
from capstan.runtime.picker.inference_pool import failure_mode, label_selector, pool_targets
from capstan.runtime.picker.picker_flags import FailureMode


def pool(labels=None, ports=(8000,), mode=None) -> dict:
    spec: dict = {"selector": {"matchLabels": labels or {"app": "llm", "capstan.dev/model": "tiny"}}}
    spec["targetPorts"] = [{"number": p} for p in ports]
    if mode:
        spec["endpointPickerRef"] = {"name": "picker", "port": {"number": 9002}, "failureMode": mode}
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p"},
        "spec": spec,
    }


def pod(ip: str | None, ready: bool = True, deleting: bool = False) -> dict:
    meta = {"name": f"pod-{ip}", **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"metadata": meta, "status": {**status, **({"podIP": ip} if ip else {})}}


def test_ready_pods_on_every_target_port():
    pods = [pod("10.0.0.1"), pod("10.0.0.2", ready=False), pod(None), pod("10.0.0.3", deleting=True), pod("fd00::4")]
    assert pool_targets(pool(ports=(8000, 8001)), pods) == [
        Target("http://10.0.0.1:8000"),
        Target("http://10.0.0.1:8001"),
        Target("http://[fd00::4]:8000"),
        Target("http://[fd00::4]:8001"),
    ]


def test_selector_ports_and_failure_mode():
    assert label_selector(pool()) == "app=llm,capstan.dev/model=tiny"
    with pytest.raises(ValueError, match="matchLabels is empty"):
        label_selector({"metadata": {"name": "p"}, "spec": {"selector": {}}})
    with pytest.raises(ValueError, match="targetPorts"):
        pool_targets(pool(ports=()), [pod("10.0.0.1")])
    assert failure_mode(pool()) == FailureMode.FAIL_CLOSE  # GIE's default
    assert failure_mode(pool(mode="FailOpen")) == FailureMode.FAIL_OPEN
