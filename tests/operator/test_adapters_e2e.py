"""LoRA adapters on the real control plane: the API server refuses bad adapter specs naming the field; the operator
renders the flags, the ConfigMap and its mount; an edit of spec.adapters rewrites the ConfigMap and leaves the
Deployment's pod template (and so its pods) alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from control_plane import wait_for

from capstan.operator import adapters, api

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "gateway"))
from processes import start_replica  # noqa: E402

pytestmark = pytest.mark.cluster
MODEL = {"uri": "hf://Qwen/Qwen3-0.6B", "servedName": "qwen3"}
SQL = {"name": "qwen3-sql", "source": "hf://org/qwen3-sql-lora@v2"}
SUPPORT = {"name": "qwen3-support", "source": "pvc://lora-adapters/qwen3/support"}


def manifest(name: str, **spec) -> str:
    spec.setdefault("model", MODEL)
    return yaml.safe_dump(
        {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "metadata": {"name": name}, "spec": spec}
    )


def eventually(what, check, timeout=90.0):
    return wait_for(what, check, timeout=timeout, interval=0.5)


def bound_claim(cluster, namespace: str, claim: str) -> None:
    """A claim bound to a hostPath volume made for it (the test cluster has no provisioner)."""
    volume = f"{claim}-{namespace}"
    objects = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": f"/tmp/{volume}"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    eventually(
        f"claim {claim} bound",
        lambda: cluster.get_json("pvc", claim, "-n", namespace)["status"].get("phase") == "Bound",
    )


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ({"adapters": [SQL, dict(SUPPORT, name="qwen3-sql")]}, "spec.adapters[1]", "Duplicate value"),
        ({"adapters": [{"name": "Qwen3_SQL", "source": "hf://org/a"}]}, "spec.adapters[0].name", "should match"),
        ({"adapters": [{"name": "org/sql", "source": "hf://org/a"}]}, "spec.adapters[0].name", "should match"),
        ({"adapters": [{"name": "sql", "source": "http://x/a"}]}, "spec.adapters[0].source", "should match"),
        ({"adapters": [{"name": "sql"}]}, "spec.adapters[0].source", "Required value"),
        ({"adapters": [{"name": "qwen3", "source": "hf://org/a"}]}, "spec.adapters", "must differ from"),
        ({"lora": {"maxLoras": 8, "maxCpuLoras": 4}}, "spec.lora.maxCpuLoras", "at least spec.lora.maxLoras"),
        ({"lora": {"maxLoraRank": 0}}, "spec.lora.maxLoraRank", "greater than or equal to 1"),
    ],
)
def test_api_server_refuses_bad_adapters_naming_the_field(cluster, chart, namespace, spec, field, words):
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest("bad", **spec), check=False)
    assert result.returncode != 0, f"accepted: {spec}"
    assert field in result.stderr and words in result.stderr, result.stderr


def test_adapters_render_and_an_edit_reaches_the_configmap_without_a_rollout(cluster, operator, namespace):
    def get(*what):
        return cluster.get_json(*what, "-n", namespace)

    bound_claim(cluster, namespace, "lora-adapters")  # the scheduler holds pods whose claim is missing or unbound
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest("lora", adapters=[SQL, SUPPORT], replicas=2))
    deployment = eventually("the Deployment", lambda: get("deployment", "lora"))
    pod_spec = deployment["spec"]["template"]["spec"]
    args = pod_spec["containers"][0]["args"]
    assert args[args.index("--enable-lora") :][:3] == ["--enable-lora", "--lora-modules-file", adapters.MODULES_FILE]
    assert {"name": "adapters", "configMap": {"name": "lora-adapters", "defaultMode": 420}} in pod_spec["volumes"]
    mounts = {m["mountPath"]: m for m in pod_spec["containers"][0]["volumeMounts"]}
    assert mounts[adapters.MOUNT]["name"] == "adapters" and "subPath" not in mounts[adapters.MOUNT]
    assert mounts["/mnt/adapters/lora-adapters"]["readOnly"] is True
    configmap = get("configmap", "lora-adapters")
    isvc = get("inferenceservice", "lora")
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    assert json.loads(configmap["data"][adapters.MODULES_KEY]) == [
        {"name": "qwen3-sql", "path": "hf://org/qwen3-sql-lora@v2"},
        {"name": "qwen3-support", "path": "/mnt/adapters/lora-adapters/qwen3/support"},
    ]

    def rolled_out():
        current = get("deployment", "lora")
        status = current.get("status", {})
        return status.get("observedGeneration") == current["metadata"]["generation"] and (
            status.get("updatedReplicas") == status.get("readyReplicas") == 2
        )

    eventually("two ready pods", rolled_out)
    before = get("deployment", "lora")
    pods_before = {
        p["metadata"]["uid"] for p in get("pods", "-l", "serving.capstan.dev/inferenceservice=lora")["items"]
    }
    replicasets_before = {
        rs["metadata"]["name"] for rs in get("replicasets", "-l", "serving.capstan.dev/inferenceservice=lora")["items"]
    }

    # Replace one adapter, add two (an hf one and one on the already-mounted claim), reorder.
    edited = [
        {"name": "qwen3-summary", "source": "pvc://lora-adapters/qwen3/summary"},
        SUPPORT,
        {"name": "qwen3-sql-v3", "source": "hf://org/qwen3-sql-lora@v3"},
    ]
    cluster.kubectl(
        "patch", "csvc", "lora", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": {"adapters": edited}})
    )

    def configmap_names():
        data = json.loads(get("configmap", "lora-adapters")["data"][adapters.MODULES_KEY])
        return [m["name"] for m in data]

    eventually(
        "the ConfigMap rewritten", lambda: configmap_names() == ["qwen3-summary", "qwen3-support", "qwen3-sql-v3"]
    )
    eventually(
        "the edit observed",
        lambda: get("inferenceservice", "lora")["status"].get("observedGeneration") == 2,
    )
    after = get("deployment", "lora")
    assert after["metadata"]["generation"] == before["metadata"]["generation"]  # the template was not touched
    assert after["spec"]["template"] == before["spec"]["template"]
    pods_after = {p["metadata"]["uid"] for p in get("pods", "-l", "serving.capstan.dev/inferenceservice=lora")["items"]}
    assert pods_after == pods_before  # no pod replaced
    assert {
        rs["metadata"]["name"] for rs in get("replicasets", "-l", "serving.capstan.dev/inferenceservice=lora")["items"]
    } == (replicasets_before)
    status = get("inferenceservice", "lora")["status"]
    assert [a["name"] for a in status["adapters"]] == ["qwen3-summary", "qwen3-support", "qwen3-sql-v3"]
    assert any(c["type"] == "AdaptersLoaded" for c in status["conditions"])  # kwok's pods serve no /v1/models

    # LoRA off: the flags, the mount and the ConfigMap go (this one does roll the pods).
    cluster.kubectl(
        "patch", "csvc", "lora", "-n", namespace, "--type=json", "-p", '[{"op": "remove", "path": "/spec/adapters"}]'
    )
    eventually(
        "the ConfigMap removed",
        lambda: cluster.kubectl("get", "configmap", "lora-adapters", "-n", namespace, check=False).returncode != 0,
    )
    template = get("deployment", "lora")["spec"]["template"]["spec"]
    assert "--enable-lora" not in template["containers"][0]["args"]
    assert all(v["name"] != "adapters" for v in template["volumes"])

    def status_of_generation_3():
        status = get("inferenceservice", "lora")["status"]
        return status if status.get("observedGeneration") == 3 else None

    status = eventually("status without adapters", status_of_generation_3)
    assert "adapters" not in status and all(c["type"] != "AdaptersLoaded" for c in status["conditions"])


class KubeletStandIn:
    """What the kubelet does for a real pod, for a real `capstan serve` on this machine: write the mounted ConfigMap's
    adapters file, with the claim's mount path mapped to the local folder that plays the claim."""

    def __init__(self, cluster, namespace: str, claim: str, claim_folder: Path, modules_file: Path):
        self.cluster, self.namespace = cluster, namespace
        self.mount, self.folder, self.file = f"{adapters.CLAIMS_MOUNT}/{claim}", str(claim_folder), modules_file

    def sync(self) -> None:
        configmap = self.cluster.get_json("configmap", "tiny-adapters", "-n", self.namespace)
        text = configmap["data"][adapters.MODULES_KEY].replace(self.mount, self.folder)
        if not self.file.exists() or self.file.read_text() != text:
            staged = self.file.with_suffix(".tmp")
            staged.write_text(text)
            staged.replace(self.file)


@pytest.mark.slow
def test_status_reports_what_a_real_server_loaded_and_follows_an_edit(cluster, operator, namespace, tmp_path):
    sys.path.insert(0, str(TESTS))
    from lora_adapters import write_adapter

    from capstan.runtime.config import DEFAULT_MODEL

    claim_folder = tmp_path / "claim"
    for seed, name in enumerate(["sql", "support", "summary"]):
        write_adapter(claim_folder / "tiny" / name, DEFAULT_MODEL, seed=seed, rank=4)
    modules_file = tmp_path / "adapters.json"
    modules_file.write_text("[]")
    server = start_replica(
        "tiny", extra=["--enable-lora", "--max-lora-rank", "8", "--lora-modules-file", str(modules_file)]
    ).wait_ready()
    try:
        with operator.reading_pods_at(f"127.0.0.1:{server.port}"):
            bound_claim(cluster, namespace, "lora-adapters")
            sources = {n: {"name": n, "source": f"pvc://lora-adapters/tiny/{n}"} for n in ["sql", "support", "summary"]}
            spec = {"model": {"uri": "hf://capstan/tiny", "servedName": "tiny"}, "replicas": 1}
            spec["adapters"] = [sources["sql"], sources["support"]]
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest("tiny", **spec))
            kubelet = KubeletStandIn(cluster, namespace, "lora-adapters", claim_folder, modules_file)

            def loaded(names: list[str]):
                def check():
                    kubelet.sync()
                    status = cluster.get_json("inferenceservice", "tiny", "-n", namespace)["status"]
                    condition = next((c for c in status["conditions"] if c["type"] == "AdaptersLoaded"), {})
                    counts = {a["name"]: a["loadedReplicas"] for a in status.get("adapters", [])}
                    replica = status.get("replicaAdapters", [{}])[0]
                    done = condition.get("status") == "True" and counts == dict.fromkeys(names, 1)
                    return done and replica.get("adapters") == sorted(names) and status

                return check

            status = eventually("the server's adapters in status", loaded(["sql", "support"]), timeout=120)
            pods = cluster.get_json("pods", "-n", namespace, "-l", "serving.capstan.dev/inferenceservice=tiny")["items"]
            pod = pods[0]
            assert status["replicaAdapters"] == [{"pod": pod["metadata"]["name"], "adapters": ["sql", "support"]}]

            spec["adapters"] = [sources["support"], sources["summary"]]  # one added, one removed
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest("tiny", **spec))
            status = eventually("the edit loaded by the running server", loaded(["support", "summary"]), timeout=120)
            assert status["observedGeneration"] == 2
            assert cluster.get_json("deployment", "tiny", "-n", namespace)["metadata"]["generation"] == 1  # no rollout
            models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
            assert {m["id"]: m.get("parent") for m in models} == {"tiny": None, "support": "tiny", "summary": "tiny"}
    finally:
        server.stop()
