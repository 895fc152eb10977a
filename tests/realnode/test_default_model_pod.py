"""The image's own default: a pod running `capstan serve` with no model (SmolLM2-135M-Instruct, in the image) and
an empty cache compiles nothing: `make image` baked its programs (image/bake_programs.py), and the pod's start
copies them in. How long it took to be ready after its container started is printed (a figure, not a bound)."""

from __future__ import annotations

import re
from datetime import datetime

import openai
import pytest
import yaml
from build import USER_ID
from control_plane import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.slow]
NAMESPACE = "default-model"
TIMEOUT = 300  # an image that bakes nothing still serves, after compiling: slower, but the log then fails the test


def manifests(image: str) -> str:
    labels = {"app": "default-model"}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "default-model", "labels": labels},
        "spec": {
            "securityContext": {"runAsUser": USER_ID, "runAsGroup": USER_ID, "runAsNonRoot": True},
            "containers": [
                {
                    "name": "capstan",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "args": ["capstan", "serve", "--host", "0.0.0.0", "--port", "8000"],  # no model: the image's
                    "ports": [{"containerPort": 8000}],
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": 8000}, "periodSeconds": 1},
                    "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False},
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],  # an empty cache, as a new pod has
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "default-model"},
        "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8000}]},
    }
    return yaml.safe_dump_all([pod, service])


def seconds(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


@pytest.fixture
def namespace(real_cluster):
    real_cluster.kubectl("create", "namespace", NAMESPACE)
    wait_for(
        "the namespace's default service account",
        lambda: real_cluster.kubectl("get", "sa", "default", "-n", NAMESPACE, check=False).returncode == 0,
        60,
    )
    yield NAMESPACE
    real_cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", check=False, timeout=180)


def test_the_images_default_model_pod_compiles_nothing(real_cluster, image, namespace):
    real_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifests(image[1]))

    def logs() -> str:
        return real_cluster.kubectl("logs", "-n", namespace, "default-model", check=False).stdout

    def ready():
        pod = real_cluster.get_json("pod", "default-model", "-n", namespace)
        condition = next((c for c in pod["status"].get("conditions", []) if c["type"] == "Ready"), {})
        return pod if condition.get("status") == "True" else None

    try:
        pod = wait_for("the default model's pod ready", ready, TIMEOUT, interval=1)
        done = wait_for("its background compilation done", lambda: "background compilation done" in logs(), 240)
    except TimeoutError:
        print(logs()[-4000:])
        raise
    assert done
    log = logs()
    assert re.search(r"[1-9]\d* compiled program\(s\) of the image's default model copied", log), log[-4000:]
    assert re.search(r"native CPU block matmul: \S+/capstan/runtime/kernels/cpu/block_matmul-", log), log[-4000:]
    # the first request's programs (kept whole: not even traced) and then every other one: all from the image
    assert re.search(r"needs in [\d.]+ s \(2 loaded whole from the program store, nothing compiled\)", log), log[-4000:]
    assert re.search(r"since the start: [1-9]\d* loaded from the compilation cache, 0 compiled\)", log), log[-4000:]
    container = pod["status"]["containerStatuses"][0]
    ready_at = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"]
    print(
        f"\nthe default model's pod: ready {seconds(ready_at) - seconds(container['state']['running']['startedAt']):.0f} s"
        " after its container started"
    )

    ip = real_cluster.get_json("service", "default-model", "-n", namespace)["spec"]["clusterIP"]
    client = openai.OpenAI(base_url=f"http://{ip}/v1", api_key="none", timeout=60, max_retries=0)
    answer = client.chat.completions.create(  # greedy: at the model's temperature 0.2 some answers miss Paris
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
    )
    assert "Paris" in answer.choices[0].message.content, answer
