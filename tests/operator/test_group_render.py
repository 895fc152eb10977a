"""render_group.py and host_groups.py: multi-host replicas as StatefulSet groups or a LeaderWorkerSet, and
how their readiness and rollout are judged per group."""

from capstan.operator import api, host_groups, render, render_group
from capstan.operator.accelerators import topology_chips

OWNER = {"metadata": {"name": "llama", "namespace": "serving", "uid": "1234"}}
TPU_SLICE = {"accelerator": {"type": "tpu-v5p", "count": 4, "topology": "2x2x2"}, "parallelism": {"hosts": 2}}


def spec(**fields):
    fields.setdefault("model", {"uri": "hf://meta-llama/Llama-3.1-8B"})
    fields.setdefault("image", "capstan:test")
    return api.InferenceServiceSpec.model_validate(fields)


def env_of(template):
    return {e["name"]: e for e in template["spec"]["containers"][0]["env"]}


def test_a_tpu_slice_replica_is_a_statefulset_of_its_hosts():
    sts = render_group.render_group_statefulset(OWNER, spec(**TPU_SLICE), replica=1)
    assert sts["kind"] == "StatefulSet" and sts["metadata"]["name"] == "llama-1"
    assert sts["metadata"]["ownerReferences"][0]["uid"] == "1234"
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "llama-hosts"
    assert sts["spec"]["podManagementPolicy"] == "Parallel" and sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert sts["spec"]["selector"]["matchLabels"] == {render.INSTANCE_LABEL: "llama", render_group.REPLICA_LABEL: "1"}
    template = sts["spec"]["template"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"google.com/tpu": 4}
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x2x2",
    }
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "8"  # every chip
    assert {"name": "coordinator", "containerPort": 8476, "protocol": "TCP"} in container["ports"]
    env = env_of(template)
    assert env["JAX_COORDINATOR_ADDRESS"]["value"] == "llama-1-0.llama-hosts.serving.svc.cluster.local:8476"
    assert env["JAX_NUM_PROCESSES"]["value"] == "2"
    assert (
        env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    assert "HF_HOME" in env  # the single-host environment is kept
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"  # a refused shape reaches status
    affinity = pod["affinity"]
    assert (
        affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"]
        == "kubernetes.io/hostname"
    )
    assert (
        affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"]
        == "cloud.google.com/gke-nodepool"
    )


def test_multi_gpu_hosts_get_gpu_counts_and_no_node_pool_affinity():
    s = spec(accelerator={"type": "nvidia-h100", "count": 8}, parallelism={"hosts": 2, "tensor": 8})
    pod = render_group.render_group_statefulset(OWNER, s, replica=0)["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert "podAffinity" not in pod["affinity"] and "podAntiAffinity" in pod["affinity"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "8"


def test_user_affinity_replaces_the_rendered_one():
    s = spec(**TPU_SLICE, affinity={"nodeAffinity": {"x": 1}})
    assert render_group.render_group_statefulset(OWNER, s, 0)["spec"]["template"]["spec"]["affinity"] == {
        "nodeAffinity": {"x": 1}
    }


def test_statefulset_path_renders_a_headless_service_and_a_leader_only_service():
    objects = render_group.render_all_groups(OWNER, spec(**TPU_SLICE), replicas=3, leader_worker_set=False)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Service", "llama"),
        ("PodDisruptionBudget", "llama"),
        ("Service", "llama-hosts"),
        ("StatefulSet", "llama-0"),
        ("StatefulSet", "llama-1"),
        ("StatefulSet", "llama-2"),
    ]
    service, hosts = objects[0], objects[2]
    assert service["spec"]["selector"] == {render.INSTANCE_LABEL: "llama", "apps.kubernetes.io/pod-index": "0"}
    assert hosts["spec"]["clusterIP"] == "None" and hosts["spec"]["publishNotReadyAddresses"] is True
    assert hosts["spec"]["selector"] == render.selector("llama")
    assert {p["name"] for p in hosts["spec"]["ports"]} == {"coordinator", "http"}


def test_leader_worker_set_path():
    objects = render_group.render_all_groups(OWNER, spec(**TPU_SLICE), replicas=3, leader_worker_set=True)
    assert [o["kind"] for o in objects] == ["Service", "PodDisruptionBudget", "LeaderWorkerSet"]
    assert objects[0]["spec"]["selector"][render_group.LWS_WORKER_INDEX_LABEL] == "0"
    lws = objects[2]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["metadata"]["name"] == "llama-hosts"
    assert lws["metadata"]["annotations"] == {
        "leaderworkerset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    assert lws["spec"]["replicas"] == 3 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    template = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    env_names = [e["name"] for e in template["spec"]["containers"][0]["env"]]
    assert env_names.index("CAPSTAN_GROUP_INDEX") < env_names.index("JAX_COORDINATOR_ADDRESS")  # $(VAR) order
    env = env_of(template)
    assert (
        env["JAX_COORDINATOR_ADDRESS"]["value"]
        == "llama-hosts-$(CAPSTAN_GROUP_INDEX).llama-hosts.serving.svc.cluster.local:8476"
    )
    assert (
        env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
    )


def test_single_host_keeps_the_deployment():
    s = spec(accelerator={"type": "nvidia-l4", "count": 2}, parallelism={"tensor": 2})
    assert not render_group.is_multi_host(s)
    d = render.render_deployment(OWNER, s, replicas=1)
    c = d["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"
    assert not {"JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"} & {e["name"] for e in c["env"]}
    assert render.render_service(OWNER)["spec"]["selector"] == render.selector("llama")


def test_tensor_parallel_size_defaults():
    assert spec().tensor_parallel_size() == 1
    assert spec(runtime={"tensorParallelSize": 2}).tensor_parallel_size() == 2
    assert spec(parallelism={"tensor": 4}).tensor_parallel_size() == 4
    assert spec(**TPU_SLICE).tensor_parallel_size() == 8
    assert topology_chips("2x2x2") == 8 and topology_chips("4x4") == 16


def test_crd_checks_tpu_shapes_with_cel_naming_the_fields():
    from capstan.operator.crd import inference_service_crd

    schema = inference_service_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = {r.get("fieldPath"): r for r in schema["x-kubernetes-validations"]}
    assert "spec.parallelism.hosts x spec.accelerator.count" in rules[".accelerator.topology"]["messageExpression"]
    assert "must divide" in rules[".parallelism.tensor"]["message"]
    accelerator = schema["properties"]["accelerator"]["x-kubernetes-validations"]
    assert any("'tpu-v5p': [4]" in r["rule"] for r in accelerator)
    assert schema["properties"]["parallelism"]["properties"]["hosts"]["minimum"] == 1


def _sts(replica, generation=2, observed=2, revision="new"):
    return {
        "metadata": {
            "name": f"llama-{replica}",
            "generation": generation,
            "labels": {render_group.REPLICA_LABEL: str(replica)},
        },
        "spec": {"replicas": 2},
        "status": {"observedGeneration": observed, "updateRevision": revision},
    }


def _pod(replica, index, revision="new", ready=True, terminating=False):
    meta = {
        "name": f"llama-{replica}-{index}",
        "labels": {
            render_group.REPLICA_LABEL: str(replica),
            render_group.POD_INDEX_LABEL: str(index),
            host_groups.REVISION_LABEL: revision,
        },
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_a_group_is_ready_only_when_all_its_hosts_are():
    statefulsets = [_sts(0), _sts(1)]
    pods = [_pod(0, 0), _pod(0, 1), _pod(1, 0), _pod(1, 1, ready=False)]
    status = host_groups.summarize(statefulsets, pods)["status"]
    assert status["replicas"] == 2 and status["readyReplicas"] == 1 and status["updatedReplicas"] == 2
    assert host_groups.summarize(statefulsets, pods[:3])["status"]["readyReplicas"] == 1  # a host missing


def test_rollout_replaces_one_whole_group_at_a_time():
    statefulsets = [_sts(0), _sts(1)]
    old = [_pod(0, 0, "old"), _pod(0, 1, "old"), _pod(1, 0, "old"), _pod(1, 1, "old")]
    group = host_groups.group_to_replace(statefulsets, old)
    assert group is not None and group.name == "llama-0" and group.pods == ("llama-0-0", "llama-0-1")
    # Group 0 is being recreated: group 1 waits until group 0 is ready again.
    restarting = [_pod(0, 0, ready=False), _pod(0, 1, ready=False), *old[2:]]
    assert host_groups.group_to_replace(statefulsets, restarting) is None
    done_with_0 = [_pod(0, 0), _pod(0, 1), *old[2:]]
    assert host_groups.group_to_replace(statefulsets, done_with_0).name == "llama-1"
    assert host_groups.summarize(statefulsets, done_with_0)["status"]["updatedReplicas"] == 1
    assert host_groups.group_to_replace(statefulsets, [_pod(r, i) for r in (0, 1) for i in (0, 1)]) is None


def test_rollout_waits_for_the_controller_and_prefers_broken_groups():
    stale = [_sts(0, generation=3, observed=2), _sts(1)]
    assert host_groups.group_to_replace(stale, [_pod(0, 0, "old"), _pod(0, 1, "old")]) is None
    statefulsets = [_sts(0), _sts(1)]
    pods = [_pod(0, 0, "old"), _pod(0, 1, "old"), _pod(1, 0, "old"), _pod(1, 1, "old", ready=False)]
    assert host_groups.group_to_replace(statefulsets, pods).name == "llama-1"


def test_leaders_are_process_zero():
    assert render_group.is_leader(_pod(0, 0)) and not render_group.is_leader(_pod(0, 1))
    assert render_group.is_leader({"metadata": {"labels": {render.INSTANCE_LABEL: "llama"}}})
    assert not render_group.is_leader({"metadata": {"labels": {render_group.LWS_WORKER_INDEX_LABEL: "2"}}})
