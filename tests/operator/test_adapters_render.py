"""spec.adapters -> the LoRA flags, the adapters' ConfigMap and what each source needs in the pod; the list can
change without changing the pod template (the running servers reload it), and the status reports each replica's."""

import json

import pytest

from capstan.operator import adapters, api, render, render_group
from capstan.operator.adapter_status import adapter_report
from capstan.operator.status import compute_status

OWNER = {"metadata": {"name": "qwen", "namespace": "serving", "uid": "1234"}}
SQL = {"name": "sql", "source": "hf://org/qwen-sql-lora@v2"}
CHAT = {"name": "chat", "source": "pvc://adapters/qwen/chat"}


def spec(**fields):
    fields.setdefault("model", {"uri": "hf://Qwen/Qwen3-0.6B", "servedName": "qwen"})
    fields.setdefault("image", "capstan:test")
    return api.InferenceServiceSpec.model_validate(fields)


def rendered(s):
    objects = {obj["kind"]: obj for obj in render.render_all(OWNER, s, replicas=2)}
    template = objects["Deployment"]["spec"]["template"]
    return objects, template, template["spec"]["containers"][0]


def modules(objects):
    return json.loads(objects["ConfigMap"]["data"][adapters.MODULES_KEY])


def test_two_adapters_render_the_flags_the_configmap_and_its_mount():
    objects, template, container = rendered(spec(adapters=[SQL, CHAT], lora={"maxLoras": 2, "maxLoraRank": 16}))
    args = container["args"]
    assert args[args.index("--enable-lora") :] == [
        "--enable-lora",
        "--lora-modules-file",
        "/etc/capstan/adapters/adapters.json",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
    ]
    configmap = objects["ConfigMap"]
    assert configmap["metadata"]["name"] == "qwen-adapters"
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == "1234"
    assert modules(objects) == [
        {"name": "sql", "path": "hf://org/qwen-sql-lora@v2"},  # the server downloads it, as it does models
        {"name": "chat", "path": "/mnt/adapters/adapters/qwen/chat"},
    ]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["adapters"] == {"name": "adapters", "configMap": {"name": "qwen-adapters"}}
    assert volumes["adapters-adapters"]["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "subPath" not in mounts["/etc/capstan/adapters"]  # a subPath mount never sees the ConfigMap change
    assert mounts["/etc/capstan/adapters"]["readOnly"] and mounts["/mnt/adapters/adapters"]["readOnly"]
    kinds = [obj["kind"] for obj in render.render_all(OWNER, spec(adapters=[SQL]), 1)]
    assert kinds.index("ConfigMap") < kinds.index("Deployment")  # the pods' volume exists before them


def test_editing_hf_and_mounted_claim_adapters_changes_the_configmap_only():
    before_objects, before, _ = rendered(spec(adapters=[SQL, CHAT]))
    edited = [
        CHAT,
        {"name": "sql-v3", "source": "hf://org/qwen-sql-lora@v3"},
        {"name": "summary", "source": "pvc://adapters/qwen/summary"},
    ]
    after_objects, after, _ = rendered(spec(adapters=edited))
    assert after == before  # no rollout: the running servers re-read the mounted list
    assert modules(after_objects) != modules(before_objects)
    assert [m["name"] for m in modules(after_objects)] == ["chat", "sql-v3", "summary"]


def test_lora_flags_do_not_depend_on_the_adapter_count():
    many = [{"name": f"a{i}", "source": f"hf://org/a{i}"} for i in range(40)]
    assert rendered(spec(adapters=many))[1] == rendered(spec(adapters=many[:1]))[1]


def test_flags_only_with_adapters_or_spec_lora():
    objects, template, container = rendered(spec())
    assert "--enable-lora" not in container["args"] and "ConfigMap" not in objects
    assert all(v["name"] != "adapters" for v in template["spec"]["volumes"])
    objects, _, container = rendered(spec(lora={}))  # on ahead of time: the first adapter will not roll the pods
    assert container["args"][-3:] == ["--enable-lora", "--lora-modules-file", "/etc/capstan/adapters/adapters.json"]
    assert modules(objects) == []


def test_adapter_on_the_models_claim_reuses_its_mount():
    s = spec(model={"uri": "pvc://weights/qwen3"}, adapters=[{"name": "sql", "source": "pvc://weights/lora/sql"}])
    objects, template, _ = rendered(s)
    assert modules(objects) == [{"name": "sql", "path": "/mnt/models/lora/sql"}]
    assert [v["name"] for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v] == ["model-source"]


def test_object_store_adapters_download_at_pod_start_in_a_stable_order():
    s3 = {"name": "s3-sql", "source": "s3://bucket/lora/sql"}
    gs = {"name": "gs-chat", "source": "gs://bucket/lora/chat"}
    objects, template, _ = rendered(spec(adapters=[s3, gs]))
    (init,) = template["spec"]["initContainers"]
    assert init["name"] == "adapter-download" and init["command"] == ["sh", "-c"]
    assert init["args"][2:] == [
        ":gcs:bucket/lora/chat",
        "/var/cache/capstan/adapters/gs/bucket/lora/chat",
        ":s3:bucket/lora/sql",
        "/var/cache/capstan/adapters/s3/bucket/lora/sql",
    ]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert modules(objects)[0] == {"name": "s3-sql", "path": "/var/cache/capstan/adapters/s3/bucket/lora/sql"}
    assert rendered(spec(adapters=[gs, s3]))[1] == template  # the list's order does not roll the pods
    assert rendered(spec(adapters=[gs]))[1] != template  # a new object-store adapter does (documented)


def test_model_download_and_adapter_download_both_run():
    s = spec(model={"uri": "gs://bucket/qwen3"}, adapters=[{"name": "sql", "source": "s3://bucket/sql"}])
    names = [c["name"] for c in rendered(s)[1]["spec"]["initContainers"]]
    assert names == ["model-download", "adapter-download"]


def test_long_claim_names_still_make_valid_volume_names():
    claim = "a" * 60
    s = spec(adapters=[{"name": "x", "source": f"pvc://{claim}/x"}])
    volume = next(v for v in rendered(s)[1]["spec"]["volumes"] if v["name"].startswith("adapters-"))
    assert len(volume["name"]) <= 63 and volume["persistentVolumeClaim"]["claimName"] == claim


def test_an_adapter_may_not_take_the_models_served_name():
    with pytest.raises(ValueError, match="spec.adapters"):
        spec(model={"uri": "pvc://weights/qwen3"}, adapters=[{"name": "qwen3", "source": "hf://org/a"}])
    with pytest.raises(ValueError, match="spec.adapters"):
        spec(adapters=[{"name": "qwen", "source": "hf://org/a"}])
    for bad in ("Has-Upper", "org/name", "-dash", "x" * 64):
        with pytest.raises(ValueError):
            spec(adapters=[{"name": bad, "source": "hf://org/a"}])
    with pytest.raises(ValueError):
        spec(adapters=[{"name": "ok", "source": "http://example.com/a"}])


def test_multi_host_groups_mount_the_list_too():
    s = spec(
        adapters=[SQL],
        accelerator={"type": "tpu-v5p", "count": 4, "topology": "2x2x2"},
        parallelism={"hosts": 2},
    )
    for leader_worker_set in (False, True):
        objects = render_group.render_all_groups(OWNER, s, 1, leader_worker_set)
        assert objects[0]["kind"] == "ConfigMap"
        workload = objects[-1]["spec"]
        template = workload.get("template") or workload["leaderWorkerTemplate"]["workerTemplate"]
        assert "--enable-lora" in template["spec"]["containers"][0]["args"]
        assert {"name": "adapters", "configMap": {"name": "qwen-adapters"}} in template["spec"]["volumes"]


def test_report_counts_each_adapter_and_lists_each_replica():
    s = spec(adapters=[SQL, CHAT])
    report = adapter_report(s, {"qwen-b": ["chat", "sql"], "qwen-a": ["sql"]})
    assert report.fields["adapters"] == [{"name": "sql", "loadedReplicas": 2}, {"name": "chat", "loadedReplicas": 1}]
    assert report.fields["replicaAdapters"] == [
        {"pod": "qwen-a", "adapters": ["sql"]},
        {"pod": "qwen-b", "adapters": ["chat", "sql"]},
    ]
    assert (report.loaded, report.reason) == (False, "Loading")
    assert report.message == "chat not yet on qwen-a (1 of 2 ready replicas have it)"
    done = adapter_report(s, {"qwen-a": ["chat", "sql"], "qwen-b": ["chat", "sql", "old"]})
    assert (done.loaded, done.reason) == (True, "Loaded")  # one still unloading a removed adapter: not a failure
    silent = adapter_report(s, {"qwen-a": ["chat", "sql"], "qwen-b": None})
    assert (silent.loaded, silent.reason) == (False, "Loading") and "qwen-b" in silent.message
    assert silent.fields["adapters"][0] == {"name": "sql", "loadedReplicas": 1}
    nobody = adapter_report(s, {})
    assert (nobody.loaded, nobody.reason) == (None, "NoReadyReplicas")


def test_status_carries_adapters_only_with_lora():
    common = dict(
        name="qwen",
        namespace="serving",
        generation=3,
        desired=1,
        deployment=None,
        pods=[],
        previous_conditions=[],
        now="2030-01-01T00:00:00Z",
    )
    status = compute_status(spec=spec(adapters=[SQL]), reported_adapters={"qwen-a": ["sql"]}, **common)
    condition = next(c for c in status["conditions"] if c["type"] == "AdaptersLoaded")
    assert (condition["status"], condition["reason"], condition["observedGeneration"]) == ("True", "Loaded", 3)
    assert status["adapters"] == [{"name": "sql", "loadedReplicas": 1}]
    without = compute_status(spec=spec(), **common)
    assert without["adapters"] is None and without["replicaAdapters"] is None  # merge patch: removed
    assert all(c["type"] != "AdaptersLoaded" for c in without["conditions"])
    api.InferenceServiceStatus.model_validate(status)  # the CRD's status schema holds it
