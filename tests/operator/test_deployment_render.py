"""render.py: an InferenceService spec -> Deployment, Service, PodDisruptionBudget and cache PVC."""

from pathlib import Path

import yaml

from capstan.operator import api, render

OWNER = {"metadata": {"name": "qwen", "namespace": "serving", "uid": "1234"}}


def spec(**fields):
    fields.setdefault("model", {"uri": "hf://Qwen/Qwen3-0.6B@main"})
    fields.setdefault("image", "capstan:test")
    return api.InferenceServiceSpec.model_validate(fields)


def container(deployment):
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_serve_command_is_rendered_from_the_spec():
    s = spec(
        runtime={
            "maxModelLen": 4096,
            "maxNumSeqs": 32,
            "pageSize": 16,
            "dtype": "bfloat16",
            "tensorParallelSize": 2,
            "extraArgs": ["--seed", "7"],
        },
        accelerator={"type": "nvidia-h100", "count": 2},
        drainTimeoutSeconds=45,
    )
    c = container(render.render_deployment(OWNER, s, replicas=2))
    assert c["command"] == ["capstan", "serve"]
    assert c["args"] == [
        "hf://Qwen/Qwen3-0.6B@main",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "Qwen/Qwen3-0.6B",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "32",
        "--page-size",
        "16",
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        "2",
        "--drain-timeout",
        "45",
        "--seed",
        "7",
    ]


def test_data_parallel_replicas_share_a_pod_of_gpus():
    s = spec(accelerator={"type": "nvidia-l4", "count": 4}, parallelism={"data": 4})
    args = container(render.render_deployment(OWNER, s, replicas=1))["args"]
    assert args[args.index("--data-parallel-size") + 1] == "4" and "--tensor-parallel-size" not in args
    assert "--data-parallel-size" not in container(render.render_deployment(OWNER, spec(), replicas=1))["args"]


def test_frontend_processes_follow_the_pods_cpu_request():
    def frontends(resources, accelerator="nvidia-h200"):
        s = spec(resources=resources, accelerator={"type": accelerator, "count": 1})
        args = container(render.render_deployment(OWNER, s, replicas=1))["args"]
        return args[args.index("--api-server-count") + 1] if "--api-server-count" in args else None

    assert frontends({"requests": {"cpu": "16"}}) == "4"  # one per 4 CPUs beside a GPU, at most 4
    assert frontends({"requests": {"cpu": "64"}}) == "4"
    assert frontends({"requests": {"cpu": "8000m"}}) == "2"
    assert frontends({"requests": {"cpu": "2"}}) == "1"
    assert frontends({"requests": {"cpu": "16"}}, accelerator="cpu") == "1"  # the engine needs the cores
    assert frontends({"limits": {"cpu": "16"}}) is None  # no request: the server reads its own cgroup (auto)
    assert frontends(None) is None


def test_probes_and_graceful_drain_contract():
    s = spec(drainTimeoutSeconds=60, startupTimeoutSeconds=1200)
    d = render.render_deployment(OWNER, s, replicas=1)
    c, pod = container(d), d["spec"]["template"]["spec"]
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1200
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    prestop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > prestop + 60
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert d["spec"]["progressDeadlineSeconds"] > 1200


def test_gpu_accelerator_requests_devices_selects_nodes_and_tolerates_the_taint():
    s = spec(
        accelerator={"type": "nvidia-h100", "count": 4},
        nodeSelector={"pool": "serving"},
        tolerations=[{"key": "dedicated", "operator": "Exists"}],
        resources={"requests": {"cpu": "8", "memory": "64Gi"}},
    )
    pod = render.render_deployment(OWNER, s, replicas=1)["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 4 and resources["requests"]["nvidia.com/gpu"] == 4
    assert resources["requests"]["cpu"] == "8"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "serving"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"key": "dedicated", "operator": "Exists"} in pod["tolerations"]


def test_tpu_accelerator_selects_type_and_topology():
    s = spec(accelerator={"type": "tpu-v5e", "count": 8, "topology": "2x4"})
    pod = render.render_deployment(OWNER, s, replicas=1)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 8}


def test_the_tpu_example_runs_the_tpu_image_on_its_slice_as_its_comment_says():
    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs/examples/tpu-v5e.yaml").read_text())
    pod = render.render_deployment(OWNER, api.InferenceServiceSpec.model_validate(example["spec"]), replicas=1)
    pod = pod["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"].endswith(":0.1.0-tpu")
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    assert pod["containers"][0]["resources"] == {"requests": {"google.com/tpu": 8}, "limits": {"google.com/tpu": 8}}
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["containers"][0]["args"][pod["containers"][0]["args"].index("--tensor-parallel-size") + 1] == "8"


def test_cpu_has_no_device_resources_or_selectors():
    pod = render.render_deployment(OWNER, spec(), replicas=1)["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert pod["containers"][0]["resources"] == {}


def test_secrets_become_environment_variables():
    s = spec(apiKeySecret={"name": "keys", "key": "api-key"}, hfTokenSecret={"name": "hf", "key": "token"})
    env = {e["name"]: e for e in container(render.render_deployment(OWNER, s, replicas=1))["env"]}
    assert env["CAPSTAN_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}


def test_model_cache_by_size_creates_an_owned_claim_and_mounts_it():
    s = spec(modelCache={"size": "100Gi", "storageClassName": "fast"})
    claim = render.render_model_cache_claim(OWNER, s)
    assert claim["metadata"]["name"] == "qwen-model-cache"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "1234"
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi"
    volumes = render.render_deployment(OWNER, s, replicas=1)["spec"]["template"]["spec"]["volumes"]
    assert volumes[0] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "qwen-model-cache"}}


def test_existing_cache_claim_is_used_not_created():
    s = spec(modelCache={"claimName": "shared-cache"})
    assert render.render_model_cache_claim(OWNER, s) is None
    volumes = render.render_deployment(OWNER, s, replicas=1)["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["persistentVolumeClaim"]["claimName"] == "shared-cache"


def test_pvc_and_object_store_models():
    pvc = render.render_deployment(OWNER, spec(model={"uri": "pvc://weights/llama-3"}), replicas=1)
    assert container(pvc)["args"][0] == "/mnt/models/llama-3"
    assert {"name": "model-source", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pvc["spec"][
        "template"
    ]["spec"]["volumes"]
    gs = render.render_deployment(OWNER, spec(model={"uri": "gs://bucket/models/llama"}), replicas=1)
    init = gs["spec"]["template"]["spec"]["initContainers"][0]
    assert init["args"][-2:] == [":gcs:bucket/models/llama", "/var/cache/capstan/models/gs/bucket/models/llama"]
    assert container(gs)["args"][0] == "/var/cache/capstan/models/gs/bucket/models/llama"
    assert container(gs)["args"][6] == "llama"  # served name


def test_pod_template_overrides_merge():
    s = spec(
        podTemplate={
            "metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}},
            "spec": {
                "priorityClassName": "high",
                "containers": [
                    {"name": "capstan", "imagePullPolicy": "Always"},
                    {"name": "sidecar", "image": "busybox"},
                ],
            },
        }
    )
    template = render.render_deployment(OWNER, s, replicas=1)["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "a"
    assert template["metadata"]["labels"][render.INSTANCE_LABEL] == "qwen"
    assert template["metadata"]["annotations"] == {"note": "x"}
    assert template["spec"]["priorityClassName"] == "high"
    names = [c["name"] for c in template["spec"]["containers"]]
    assert names == ["capstan", "sidecar"]
    assert template["spec"]["containers"][0]["imagePullPolicy"] == "Always"
    assert template["spec"]["containers"][0]["command"] == ["capstan", "serve"]


def test_service_and_pdb_select_the_pods():
    service, pdb = render.render_service(OWNER), render.render_pod_disruption_budget(OWNER)
    pods = render.render_deployment(OWNER, spec(), replicas=1)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert service["spec"]["selector"].items() <= pods.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pods.items()
    assert render.service_url("qwen", "serving") == "http://qwen.serving.svc.cluster.local/v1"


def test_rendering_is_deterministic():
    s = spec(accelerator={"type": "nvidia-l4"}, modelCache={"size": "10Gi"})
    assert render.render_all(OWNER, s, 3) == render.render_all(OWNER, s, 3)
