"""render_pool.py and pool_status.py: spec.inferencePool -> an InferencePool of the serving pods, its endpoint
picker (Deployment, Service, ServiceAccount, Role, RoleBinding), and what status says of them. Pure: no cluster."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from restricted_profile import restricted_violations

from capstan.operator import api, pool_status, render, render_group, render_pool
from capstan.operator.status import compute_status

OWNER = {"metadata": {"name": "qwen", "namespace": "serving", "uid": "1234"}}
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "qwen3-inference-pool.yaml"


def spec(**fields):
    fields.setdefault("model", {"uri": "hf://Qwen/Qwen3-0.6B"})
    fields.setdefault("image", "capstan:test")
    fields.setdefault("inferencePool", {})
    return api.InferenceServiceSpec.model_validate(fields)


def by_kind(objects):
    return {obj["kind"]: obj for obj in objects}


def pool_objects(s, serving=None):
    return by_kind(render_pool.render_all(OWNER, s, serving or render.render_all(OWNER, s, 1)))


def test_an_empty_inference_pool_turns_it_on_with_a_fail_close_picker():
    s = spec()
    assert s.inference_pool_enabled()
    assert s.inference_pool.picker.replicas == 1 and s.inference_pool.picker.failure_mode == "FailClose"
    assert not spec(inferencePool={"enabled": False}).inference_pool_enabled()
    assert not api.InferenceServiceSpec.model_validate({"model": {"uri": "hf://org/m"}}).inference_pool_enabled()
    with pytest.raises(ValidationError, match="failureMode"):
        spec(inferencePool={"picker": {"failureMode": "FailSometimes"}})
    with pytest.raises(ValidationError, match="replicas"):
        spec(inferencePool={"picker": {"replicas": 0}})


def test_the_pool_selects_the_serving_pods_on_the_serve_port_and_names_its_picker():
    s = spec(inferencePool={"picker": {"failureMode": "FailOpen"}})
    pool = pool_objects(s)["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "qwen" and pool["metadata"]["namespace"] == "serving"
    assert pool["spec"] == {
        "selector": {"matchLabels": render.selector("qwen")},
        "targetPorts": [{"number": render.SERVER_PORT}],
        "endpointPickerRef": {"name": "qwen-epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
    }
    serving_pod_labels = render.render_deployment(OWNER, s, 1)["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= serving_pod_labels.items()


def test_a_multi_host_pool_selects_the_leaders_only():
    s = spec(accelerator={"type": "tpu-v5p", "count": 4, "topology": "2x2x2"}, parallelism={"hosts": 2})
    for leader_worker_set in (True, False):
        serving = render_group.render_all_groups(OWNER, s, 2, leader_worker_set)
        pool = pool_objects(s, serving)["InferencePool"]
        assert pool["spec"]["selector"]["matchLabels"] == render_group.leader_selector("qwen", leader_worker_set)


def test_every_object_is_owned_by_the_inference_service():
    for obj in render_pool.render_all(OWNER, spec(), render.render_all(OWNER, spec(), 1)):
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceService", "1234", True), obj["kind"]
        assert obj["metadata"]["namespace"] == "serving"


def test_the_picker_runs_capstan_picker_with_exactly_its_flags():
    deployment = pool_objects(spec(inferencePool={"picker": {"replicas": 2}}))["Deployment"]
    assert deployment["metadata"]["name"] == "qwen-epp" and deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "capstan:test"
    assert container["command"] == ["capstan", "picker"]
    assert container["args"] == [
        "--pool-name",
        "qwen",
        "--pool-namespace",
        "serving",
        "--grpc-port",
        "9002",
        "--grpc-health-port",
        "9003",
        "--metrics-port",
        "9090",
        "--failure-mode",
        "FailClose",
    ]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["resources"] == render_pool.PICKER_RESOURCES
    assert pod["serviceAccountName"] == "qwen-epp"


def test_the_picker_image_and_resources_can_be_set():
    resources = {"requests": {"cpu": "1", "memory": "512Mi"}}
    s = spec(inferencePool={"picker": {"image": "picker:1", "resources": resources}}, imagePullPolicy="Always")
    container = pool_objects(s)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "picker:1" and container["resources"] == resources
    assert container["imagePullPolicy"] == "Always"


def test_the_picker_pods_pass_the_restricted_profile():
    pod = pool_objects(spec())["Deployment"]["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []


def test_the_picker_pods_are_not_serving_pods():
    """The InferenceService's Service, PodDisruptionBudget, status and autoscaler select serving pods only."""
    s = spec()
    picker_pod_labels = pool_objects(s)["Deployment"]["spec"]["template"]["metadata"]["labels"]
    serving = by_kind(render.render_all(OWNER, s, 1))
    for selector in (serving["Service"]["spec"]["selector"], serving["Deployment"]["spec"]["selector"]["matchLabels"]):
        assert not selector.items() <= picker_pod_labels.items()
    assert render.INSTANCE_LABEL not in picker_pod_labels


def test_the_picker_service_speaks_h2c_for_ext_proc_and_exposes_metrics():
    service = pool_objects(spec())["Service"]
    assert service["metadata"]["name"] == "qwen-epp"
    assert service["spec"]["selector"] == render_pool.picker_selector("qwen")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc-ext-proc"]["port"] == 9002 and ports["grpc-ext-proc"]["appProtocol"] == "kubernetes.io/h2c"
    assert ports["http-metrics"]["port"] == 9090


def test_the_picker_may_read_pods_and_inference_pools_and_nothing_else():
    objects = pool_objects(spec())
    role, binding = objects["Role"], objects["RoleBinding"]
    assert {
        (g, r, tuple(rule["verbs"])) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    } == {
        ("", "pods", ("get", "list", "watch")),
        ("inference.networking.k8s.io", "inferencepools", ("get", "list", "watch")),
    }
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "qwen-epp"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qwen-epp", "namespace": "serving"}]
    assert objects["ServiceAccount"]["metadata"]["name"] == "qwen-epp"


def test_the_pool_comes_first_and_the_picker_deployment_last():
    kinds = [o["kind"] for o in render_pool.render_all(OWNER, spec(), render.render_all(OWNER, spec(), 1))]
    assert kinds == ["InferencePool", "ServiceAccount", "Role", "RoleBinding", "Service", "Deployment"]
    assert [kind for kind, _ in render_pool.rendered_objects("qwen")] == [
        "InferencePool",
        "Deployment",
        "Service",
        "RoleBinding",
        "Role",
        "ServiceAccount",
    ]


def test_picker_names_stay_dns_labels():
    assert render_pool.picker_name("qwen") == "qwen-epp"
    long_a, long_b = "a" * 62 + "b", "a" * 62 + "c"
    names = {render_pool.picker_name(long_a), render_pool.picker_name(long_b)}
    assert len(names) == 2 and all(len(n) <= 63 and n.endswith("-epp") for n in names)


def picker_deployment(replicas=1, ready=0, conditions=()):
    return {"status": {"replicas": replicas, "readyReplicas": ready, "conditions": list(conditions)}}


def test_status_without_the_crd_says_how_to_install_it():
    report = pool_status.pool_report("qwen", spec(), crd_served=False, picker=None)
    assert (report.ready, report.reason) == (False, "InferencePoolCRDMissing")
    assert "inferencePool.installCRD=true" in report.message and pool_status.CRD_FILE in report.message
    assert report.fields == {
        "inferencePool": {"name": "qwen", "picker": {"name": "qwen-epp", "replicas": 0, "readyReplicas": 0}}
    }


def test_status_follows_the_picker():
    starting = pool_status.pool_report("qwen", spec(), True, picker_deployment(ready=0))
    assert (starting.ready, starting.reason) == (False, "PickerStarting")
    ready = pool_status.pool_report("qwen", spec(), True, picker_deployment(ready=1))
    assert (ready.ready, ready.reason) == (True, "PickerReady")
    assert ready.fields["inferencePool"]["picker"] == {"name": "qwen-epp", "replicas": 1, "readyReplicas": 1}
    assert "kind: InferencePool, name: qwen" in ready.message
    failure = {"type": "ReplicaFailure", "status": "True", "message": 'pods "qwen-epp-1" is forbidden: violates'}
    rejected = pool_status.pool_report("qwen", spec(), True, picker_deployment(conditions=[failure]))
    assert (rejected.ready, rejected.reason) == (False, "PickerPodsRejected") and "forbidden" in rejected.message


def test_compute_status_carries_the_pool_and_its_condition_only_when_asked():
    def status(s, pool):
        return compute_status(
            name="qwen",
            namespace="serving",
            generation=1,
            spec=s,
            desired=1,
            deployment=None,
            pods=[],
            previous_conditions=[],
            now="2026-01-01T00:00:00Z",
            pool=pool,
        )

    with_pool = status(spec(), pool_status.pool_report("qwen", spec(), True, picker_deployment(ready=1)))
    assert with_pool["inferencePool"]["name"] == "qwen"
    (condition,) = [c for c in with_pool["conditions"] if c["type"] == "InferencePoolReady"]
    assert (condition["status"], condition["reason"]) == ("True", "PickerReady")
    without = status(spec(inferencePool=None), None)
    assert without["inferencePool"] is None  # a merge patch removes it
    assert "InferencePoolReady" not in [c["type"] for c in without["conditions"]]


def test_the_examples_http_route_sends_its_traffic_to_the_pool_the_operator_renders():
    service, route = yaml.safe_load_all(EXAMPLE.read_text())
    owner = {"metadata": {**service["metadata"], "namespace": "serving", "uid": "1"}}
    s = api.InferenceServiceSpec.model_validate(service["spec"])
    (pool,) = [
        o for o in render_pool.render_all(owner, s, render.render_all(owner, s, 2)) if o["kind"] == "InferencePool"
    ]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["kind"] == "HTTPRoute"
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    group, _ = pool["apiVersion"].split("/")
    assert backend == {"group": group, "kind": pool["kind"], "name": pool["metadata"]["name"]}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
