"""Scale from zero through the gateway on the real control plane: `capstan gateway` in discovery mode (under the
chart's gateway ServiceAccount) holds a request for an InferenceService at zero replicas, stamps its demand on the
resource, the operator scales 0 -> 1, and the request is answered once a ready endpoint appears in an EndpointSlice.
The same for a request naming a LoRA adapter of the InferenceService's spec: the name is known before any replica
lists it, and its demand wakes the base model.

kwok's pods serve nothing, so the endpoint the gateway finds is a real `capstan serve` on this machine's own address
(the API server refuses loopback endpoints), published in an EndpointSlice of the InferenceService's (as the
EndpointSlice controller publishes a ready pod)."""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from control_plane import wait_for, write_kubeconfig
from operator_process import RELEASE

from capstan.operator import api
from capstan.runtime.config import DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
from processes import metric, start_gateway, start_replica  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
OPERATOR_NAMESPACE = "capstan-system"


def host_address() -> str | None:
    """This machine's non-loopback IPv4 address (the route to a TEST-NET address; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.fixture
def gateway_kubeconfig(cluster, chart, tmp_path) -> Path:
    account = f"{RELEASE}-gateway"
    token = cluster.kubectl("create", "token", account, "-n", OPERATOR_NAMESPACE, "--duration=1h").stdout.strip()
    return write_kubeconfig(
        tmp_path / "kubeconfig",
        cluster.server,
        cluster.ca_cert,
        token,
        f"system:serviceaccount:{OPERATOR_NAMESPACE}:{account}",
    )


@pytest.mark.parametrize("requested", ["tiny", "tiny-sql"], ids=["model", "lora-adapter"])
def test_request_at_zero_replicas_scales_up_and_is_answered(
    cluster, operator, namespace, gateway_kubeconfig, monkeypatch, tmp_path, requested
):
    """A request for the model, or for a LoRA adapter its spec lists (which then wakes its base model)."""
    address = host_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address to publish a real replica at")
    manifest = {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"uri": "hf://capstan/tiny", "servedName": "tiny"},
            "replicas": 0,
            "minReplicas": 0,
            "maxReplicas": 2,
            "autoscaling": {"target": 4, "scaleDownStabilizationSeconds": 600},
            "adapters": [{"name": "tiny-sql", "source": "hf://capstan/tiny-sql-lora"}],
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def deployment_replicas():
        return cluster.get_json("deployment", "tiny", "-n", namespace)["spec"]["replicas"]

    wait_for("the service at zero replicas", lambda: deployment_replicas() == 0, timeout=60)

    monkeypatch.setenv("KUBECONFIG", str(gateway_kubeconfig))
    # The pod's server, with the adapter its ConfigMap lists (a local folder for the hf:// source: no network here).
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from lora_adapters import write_adapter

    modules = tmp_path / "adapters.json"
    adapter = write_adapter(tmp_path / "tiny-sql", DEFAULT_MODEL, seed=0, rank=4)
    modules.write_text(json.dumps([{"name": "tiny-sql", "path": str(adapter)}]))
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules-file", str(modules)]
    replica = start_replica("tiny", host=address, extra=lora)  # compiles now; published once the operator scales up
    gateway = start_gateway([], "--namespace", namespace, "--poll-interval", "0.5", "--hold-timeout", "150")
    result: dict = {}
    try:
        gateway.wait_ready(30)
        assert [m["id"] for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]] == ["tiny", "tiny-sql"]

        def send():
            result["response"] = httpx.post(
                f"{gateway.url}/v1/completions",
                timeout=170,
                json={"model": requested, "prompt": "Hello", "max_tokens": 3},
            )

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        wait_for("the request held", lambda: metric(gateway.url, "capstan_gateway_requests_held") == 1, timeout=20)
        wait_for(
            "the demand stamp",
            lambda: (
                api.DEMAND_ANNOTATION
                in cluster.get_json("inferenceservice", "tiny", "-n", namespace)["metadata"].get("annotations", {})
            ),
            timeout=20,
        )
        wait_for("scale from zero", lambda: deployment_replicas() == 1, timeout=30)
        events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=Scaled").stdout
        assert "scale from zero" in events

        replica.wait_ready()
        endpoint_slice = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "addressType": "IPv4",
            "metadata": {
                "name": "tiny-e2e",
                "labels": {
                    "kubernetes.io/service-name": "tiny",
                    "endpointslice.kubernetes.io/managed-by": "capstan-e2e",
                    "serving.capstan.dev/inferenceservice": "tiny",
                },
            },
            "ports": [{"name": "http", "port": replica.port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
        }
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(endpoint_slice))
        sender.join(timeout=120)
        assert not sender.is_alive(), "the held request was not released"
        response = result["response"]
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert response.json()["model"] == requested
    finally:
        gateway.stop()
        replica.stop()
