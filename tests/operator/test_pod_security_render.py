"""Every kind of pod the operator renders passes the `restricted` Pod Security Standard, checked field by field
(restricted_profile.py): single-host Deployments (the docs' examples among them), StatefulSet and LeaderWorkerSet
groups, the model download init container; and the checker itself refuses what the profile refuses."""

from pathlib import Path

import pytest
import yaml
from restricted_profile import restricted_violations

from capstan.operator import api, render, render_group

OWNER = {"metadata": {"name": "svc", "namespace": "serving", "uid": "1234"}}
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
TPU_SLICE = {"accelerator": {"type": "tpu-v5p", "count": 4, "topology": "2x2x2"}, "parallelism": {"hosts": 2}}


def spec(**fields):
    fields.setdefault("model", {"uri": "hf://Qwen/Qwen3-0.6B"})
    return api.InferenceServiceSpec.model_validate(fields)


def example(name: str) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate(yaml.safe_load((EXAMPLES / name).read_text())["spec"])


def pod_specs(spec_: api.InferenceServiceSpec) -> list[dict]:
    """The pod spec of every workload object the operator would apply for this spec, both group kinds included."""
    objects = (
        render.render_all(OWNER, spec_, 2)
        if spec_.parallelism.hosts == 1
        else render_group.render_all_groups(OWNER, spec_, 2, True)
        + render_group.render_all_groups(OWNER, spec_, 2, False)
    )
    pods = []
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            pods.append(obj["spec"]["template"]["spec"])
        elif obj["kind"] == "LeaderWorkerSet":
            pods.append(obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"])
    return pods


@pytest.mark.parametrize(
    "spec_",
    [
        example("qwen3-l4.yaml"),
        example("tpu-v5e.yaml"),
        example("llama-tpu-v5p-2-hosts.yaml"),
        example("llama-autoscaled.yaml"),
        example("qwen3-tp2-l4.yaml"),
        spec(),
        spec(model={"uri": "s3://bucket/llama"}),
        spec(model={"uri": "pvc://weights/llama"}),
        spec(modelCache={"size": "100Gi"}),
        spec(**TPU_SLICE),
        spec(**TPU_SLICE, model={"uri": "gs://bucket/llama"}),
    ],
    ids=[
        "qwen3-l4",
        "tpu-v5e",
        "tpu-v5p-2-hosts",
        "autoscaled",
        "tp2-l4",
        "cpu",
        "s3-download",
        "pvc-model",
        "pvc-cache",
        "tpu-statefulset-and-lws",
        "tpu-groups-download",
    ],
)
def test_every_rendered_pod_passes_the_restricted_profile(spec_):
    pods = pod_specs(spec_)
    assert pods
    for pod in pods:
        assert restricted_violations(pod) == []
        assert pod["securityContext"]["runAsUser"] == 65532  # the image's user (image/build.py)


def test_the_download_init_container_is_restricted_and_writes_only_to_volumes():
    (pod,) = pod_specs(spec(model={"uri": "gs://bucket/llama"}))
    (init,) = pod["initContainers"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/var/cache/capstan", "/tmp"}
    assert {"name": "HOME", "value": "/tmp"} in init["env"]


def test_the_runtime_writes_only_to_volumes():
    (pod,) = pod_specs(spec())
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}  # HOME, Triton's and other caches
    assert "emptyDir" in volumes[mounts["/var/cache/capstan"]]  # weights and XLA's compilation cache
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["HF_HOME"].startswith("/var/cache/capstan/") and env["JAX_COMPILATION_CACHE_DIR"].startswith(
        "/var/cache/capstan/"
    )


def test_a_cache_volume_override_keeps_the_scratch_volume():
    s = spec(podTemplate={"spec": {"volumes": [{"name": "model-cache", "hostPath": {"path": "/cache"}}]}})
    (pod,) = pod_specs(s)
    assert {v["name"]: v for v in pod["volumes"]} == {
        "model-cache": {"name": "model-cache", "hostPath": {"path": "/cache"}},
        "tmp": {"name": "tmp", "emptyDir": {}},
    }
    assert any("hostPath" in p for p in restricted_violations(pod))  # the user's choice; the profile refuses it


def test_privileged_only_when_the_spec_asks_and_the_profile_says_so():
    tpu = {"type": "tpu-v5e", "count": 4, "topology": "2x2"}
    (pod,) = pod_specs(spec(accelerator=tpu, security={"privileged": True}))
    assert pod["containers"][0]["securityContext"]["privileged"] is True
    assert any("privileged is true" in p for p in restricted_violations(pod))


@pytest.mark.parametrize(
    ("pod_override", "words"),
    [
        ({"securityContext": {}}, "runAsNonRoot"),
        ({"securityContext": {"runAsNonRoot": True}}, "seccompProfile"),
        (
            {"securityContext": {"runAsNonRoot": True, "runAsUser": 0, "seccompProfile": {"type": "RuntimeDefault"}}},
            "runAsUser is 0",
        ),
    ],
)
def test_the_checker_refuses_what_the_profile_refuses(pod_override, words):
    (pod,) = pod_specs(spec(podTemplate={"spec": pod_override}))
    assert any(words in p for p in restricted_violations(pod)), restricted_violations(pod)


@pytest.mark.parametrize(
    ("container_override", "words"),
    [
        ({"securityContext": {}}, "allowPrivilegeEscalation"),
        ({"securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True}}, "capabilities.drop"),
        (
            {
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]},
                    "readOnlyRootFilesystem": True,
                }
            },
            "capabilities.add",
        ),
    ],
)
def test_the_checker_refuses_container_fields(container_override, words):
    (pod,) = pod_specs(spec(podTemplate={"spec": {"containers": [{"name": "capstan", **container_override}]}}))
    assert any(words in p for p in restricted_violations(pod)), restricted_violations(pod)
