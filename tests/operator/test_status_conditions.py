"""status.py: Deployment and pods as the API server reports them -> Ready/Progressing/Degraded."""

from capstan.operator import api
from capstan.operator.status import compute_status, diagnose

SPEC = api.InferenceServiceSpec.model_validate({"model": {"uri": "hf://org/m"}, "accelerator": {"type": "nvidia-l4"}})


def deployment(replicas=2, ready=2, updated=2, available=2, generation=3, observed=3, conditions=()):
    return {
        "metadata": {"generation": generation},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "availableReplicas": available,
            "observedGeneration": observed,
            "conditions": list(conditions),
        },
    }


def pod(name="m-1", waiting=None, scheduled=None, last_exit=None):
    status = {"conditions": [], "containerStatuses": []}
    if waiting:
        status["containerStatuses"].append(
            {
                "name": "capstan",
                "image": "capstan:x",
                "restartCount": 5,
                "state": {"waiting": {"reason": waiting, "message": "details"}},
                "lastState": {"terminated": {"exitCode": last_exit}} if last_exit else {},
            }
        )
    if scheduled:
        status["conditions"].append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": scheduled}
        )
    return {"metadata": {"name": name}, "status": status}


def status_of(dep, pods=(), previous=(), desired=2):
    return compute_status(
        name="m",
        namespace="ns",
        generation=4,
        spec=SPEC,
        desired=desired,
        deployment=dep,
        pods=list(pods),
        previous_conditions=list(previous),
        now="2030-01-01T00:00:00Z",
    )


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_healthy_rollout_complete():
    s = status_of(deployment())
    assert conditions(s) == {
        "Ready": ("True", "Serving"),
        "Progressing": ("False", "Complete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert s["observedGeneration"] == 4 and s["url"] == "http://m.ns.svc.cluster.local/v1"
    assert s["readyReplicas"] == 2 and s["desiredReplicas"] == 2
    assert all(c["observedGeneration"] == 4 for c in s["conditions"])


def test_rollout_in_progress_keeps_serving():
    s = status_of(deployment(replicas=3, updated=1, ready=2))
    assert conditions(s)["Progressing"] == ("True", "RollingOut")
    assert conditions(s)["Ready"] == ("True", "Serving")


def test_image_pull_failure_is_degraded_with_the_image_named():
    s = status_of(deployment(ready=0, available=0), [pod(waiting="ImagePullBackOff")])
    assert conditions(s)["Degraded"] == ("True", "ImagePullFailed")
    assert conditions(s)["Ready"] == ("False", "ImagePullFailed")
    assert "capstan:x" in s["conditions"][2]["message"]


def test_crash_loop():
    problem = diagnose([pod(waiting="CrashLoopBackOff", last_exit=137)], SPEC)
    assert problem.reason == "CrashLoop" and "137" in problem.message


def test_no_node_with_the_accelerator():
    message = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
    problem = diagnose([pod(scheduled=message)], SPEC)
    assert problem.reason == "AcceleratorUnavailable"
    assert "nvidia-l4" in problem.message and "NVIDIA-L4" in problem.message


def test_transition_time_kept_when_status_unchanged():
    first = status_of(deployment())
    earlier = [dict(c, lastTransitionTime="2020-01-01T00:00:00Z") for c in first["conditions"]]
    again = status_of(deployment(), previous=earlier)
    assert all(c["lastTransitionTime"] == "2020-01-01T00:00:00Z" for c in again["conditions"])
    degraded = status_of(deployment(ready=0), [pod(waiting="ErrImagePull")], previous=earlier)
    assert {c["type"]: c["lastTransitionTime"] for c in degraded["conditions"]}["Degraded"] == "2030-01-01T00:00:00Z"


def test_crash_loop_quotes_the_runtimes_last_words():
    crashed = pod(waiting="CrashLoopBackOff", last_exit=2)
    crashed["status"]["containerStatuses"][0]["lastState"]["terminated"]["message"] = (
        "error: --tensor-parallel-size 3 does not divide num_attention_heads 32\n"
    )
    problem = diagnose([crashed], SPEC)
    assert problem.reason == "CrashLoop"
    assert problem.message.endswith(
        "(last exit code 2, 5 restarts): error: --tensor-parallel-size 3 does not divide num_attention_heads 32"
    )


def test_url_through_the_gateway_when_one_routes():
    s = compute_status(
        name="m",
        namespace="ns",
        generation=4,
        spec=SPEC,
        desired=2,
        deployment=deployment(),
        pods=[],
        previous_conditions=[],
        now="2030-01-01T00:00:00Z",
        url="http://capstan-gateway.capstan-system.svc.cluster.local/v1",
    )
    assert s["url"] == "http://capstan-gateway.capstan-system.svc.cluster.local/v1"
    assert "capstan-gateway" in next(c for c in s["conditions"] if c["type"] == "Ready")["message"]


def test_pods_the_api_server_refused_are_degraded_with_its_words():
    refused = {
        "type": "ReplicaFailure",
        "status": "True",
        "reason": "FailedCreate",
        "message": 'pods "m-1" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true',
    }
    s = status_of(deployment(replicas=0, ready=0, updated=0, available=0, conditions=[refused]))
    assert conditions(s)["Degraded"] == ("True", "PodsRejected")
    degraded = next(c for c in s["conditions"] if c["type"] == "Degraded")
    assert "violates PodSecurity" in degraded["message"]
