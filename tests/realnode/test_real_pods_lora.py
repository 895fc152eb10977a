"""A LoRA adapter served by a real pod: the operator (a pod, under the chart's RBAC) renders the adapters' ConfigMap,
the kubelet mounts it and the adapters' claim, `capstan serve --enable-lora` loads the adapter, the status reports it,
and the Service and the gateway (a pod too) answer for it. An adapter added to the spec then reaches the running
server through the ConfigMap alone: same pod, no restart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest
import yaml
from control_plane import wait_for
from test_real_pods_e2e import OPERATOR_NAMESPACE, condition, pods_of, service_url, tiny_inference_service, wait_serving

from capstan.operator import adapters
from capstan.runtime.config import DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lora_adapters import write_adapter  # noqa: E402

pytestmark = [pytest.mark.realnode, pytest.mark.slow, pytest.mark.timeout(1200)]
CLAIM = "lora-adapters"
LOAD_TIMEOUT = 180  # the kubelet's sync (10 s on this node), the server's poll (2 s), the operator's resync (2 s)
LORA_ARGS = ("--enable-lora", "--lora-modules-file", adapters.MODULES_FILE, "--max-lora-rank", "8")


@pytest.fixture
def namespace(real_cluster):
    name = "real-lora"
    real_cluster.kubectl("create", "namespace", name)
    wait_for(
        "the namespace's default service account",
        lambda: real_cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        60,
    )
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=true", check=False, timeout=180)
    real_cluster.kubectl("delete", "pv", f"{CLAIM}-{name}", "--wait=false", check=False)


@pytest.fixture
def adapter_claim(real_cluster, namespace, tmp_path_factory) -> Path:
    """Two PEFT adapters of the tiny model in a node folder, behind a claim bound to it (a hostPath volume)."""
    folder = tmp_path_factory.mktemp("lora-claim")
    for seed, name in enumerate(["sql", "chat"]):
        write_adapter(folder / "tiny" / name, DEFAULT_MODEL, seed=seed, rank=4)
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # the image's user, 65532, reads them
    volume = f"{CLAIM}-{namespace}"
    objects = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": str(folder), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": CLAIM},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    real_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    wait_for(
        "the adapters' claim bound",
        lambda: real_cluster.get_json("pvc", CLAIM, "-n", namespace)["status"].get("phase") == "Bound",
        60,
    )
    return folder


def adapters_loaded(cluster, namespace: str, names: list[str]):
    def check():
        isvc = cluster.get_json("inferenceservice", "tiny", "-n", namespace)
        counts = {a["name"]: a["loadedReplicas"] for a in isvc["status"].get("adapters", [])}
        loaded = condition(isvc, "AdaptersLoaded").get("status") == "True"
        return isvc if loaded and counts == dict.fromkeys(names, 1) else None

    return check


def test_a_real_pod_serves_an_adapter_and_loads_an_added_one_without_a_restart(
    real_cluster, chart, namespace, compile_cache, adapter_claim
):
    source = {n: {"name": f"tiny-{n}", "source": f"pvc://{CLAIM}/tiny/{n}"} for n in ["sql", "chat"]}
    manifest = tiny_inference_service("tiny", compile_cache, extra_args=LORA_ARGS, adapters=[source["sql"]])
    real_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
    wait_serving(real_cluster, namespace, "tiny", replicas=1)
    isvc = wait_for("tiny-sql loaded", adapters_loaded(real_cluster, namespace, ["tiny-sql"]), LOAD_TIMEOUT, interval=2)
    (pod,) = pods_of(real_cluster, namespace, "tiny")
    assert isvc["status"]["replicaAdapters"] == [{"pod": pod["metadata"]["name"], "adapters": ["tiny-sql"]}]

    client = openai.OpenAI(
        base_url=service_url(real_cluster, namespace, "tiny"), api_key="unused", max_retries=0, timeout=120
    )
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "tiny-sql"} and cards["tiny-sql"].model_extra["parent"] == "tiny"
    prompt = {"prompt": "The capstan turns", "max_tokens": 8, "temperature": 0}
    base = client.completions.create(model="tiny", **prompt).choices[0].text
    tuned = client.completions.create(model="tiny-sql", **prompt)
    assert tuned.model == "tiny-sql" and tuned.choices[0].text != base  # the adapter moves the logits

    gateway = openai.OpenAI(
        base_url=service_url(real_cluster, OPERATOR_NAMESPACE, "capstan-gateway"),
        api_key="unused",
        max_retries=0,
        timeout=120,
    )
    wait_for(
        "the gateway listing tiny-sql",
        lambda: "tiny-sql" in {m.id for m in gateway.models.list().data},
        60,
        interval=1,
    )
    assert gateway.completions.create(model="tiny-sql", **prompt).choices[0].text == tuned.choices[0].text
    with pytest.raises(openai.NotFoundError):
        gateway.completions.create(model="tiny-nope", **prompt)

    # An adapter added to the spec: the ConfigMap changes, the pod does not.
    patch = {"spec": {"adapters": [source["sql"], source["chat"]]}}
    real_cluster.kubectl("patch", "csvc", "tiny", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    wait_for(
        "tiny-chat loaded by the running server",
        adapters_loaded(real_cluster, namespace, ["tiny-sql", "tiny-chat"]),
        LOAD_TIMEOUT,
        interval=2,
    )
    (same,) = pods_of(real_cluster, namespace, "tiny")
    assert same["metadata"]["uid"] == pod["metadata"]["uid"]
    assert same["status"]["containerStatuses"][0]["restartCount"] == 0
    wait_for(
        "the gateway routing tiny-chat",
        lambda: gateway.completions.create(model="tiny-chat", **prompt).model == "tiny-chat",
        60,
        interval=1,
    )
