"""Pure functions: an InferenceService spec -> the Kubernetes objects that should exist for it.

No cluster access here; handlers.py applies what these return with server-side apply.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from capstan.operator import adapters, api, pod_security
from capstan.operator.accelerators import ACCELERATORS, TPU_TOPOLOGY_LABEL, is_tpu
from capstan.operator.model_source import CACHE_MOUNT, model_source, served_model_name
from capstan.runtime.server.frontend_count import cpu_quantity, frontends_for

SERVER_PORT = 8000
SERVICE_PORT = 80
CONTAINER_NAME = "capstan"
PRESTOP_SECONDS = 5  # time for endpoints to drop the pod before the server stops taking requests
GRACE_MARGIN_SECONDS = 10  # exit, flush logs, after the drain itself
INSTANCE_LABEL = f"{api.GROUP}/inferenceservice"


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "capstan",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "capstan-operator",
        INSTANCE_LABEL: name,
    }


def selector(name: str) -> dict[str, str]:
    return {INSTANCE_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def service_url(name: str, namespace: str) -> str:
    """The in-cluster OpenAI base URL."""
    return f"http://{name}.{namespace}.svc.cluster.local/v1"


def model_cache_claim_name(name: str, spec: api.InferenceServiceSpec) -> str | None:
    if spec.model_cache is None:
        return None
    return spec.model_cache.claim_name or f"{name}-model-cache"


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(name: str, namespace: str, owner: dict[str, Any], object_name: str | None = None) -> dict[str, Any]:
    return {
        "name": object_name or name,
        "namespace": namespace,
        "labels": labels(name),
        "ownerReferences": [owner_reference(owner)],
    }


def serve_args(spec: api.InferenceServiceSpec, model_argument: str) -> list[str]:
    """`capstan serve`'s arguments, vLLM-style."""
    runtime = spec.runtime
    args = [
        model_argument,
        "--host",
        "0.0.0.0",
        "--port",
        str(SERVER_PORT),
        "--served-model-name",
        spec.model.served_name or served_model_name(spec.model.uri),
    ]
    flags = {
        "--tokenizer": spec.model.tokenizer,
        "--max-model-len": runtime.max_model_len,
        "--max-num-seqs": runtime.max_num_seqs,
        "--page-size": runtime.page_size,
        "--dtype": None if runtime.dtype == "auto" else runtime.dtype,
        "--tensor-parallel-size": spec.tensor_parallel_size() if spec.tensor_parallel_size() > 1 else None,
        "--data-parallel-size": spec.parallelism.data if spec.parallelism.data > 1 else None,
        "--drain-timeout": spec.drain_timeout_seconds,
        "--api-server-count": _frontends(spec),
    }
    for flag, value in flags.items():
        if value is not None:
            args += [flag, str(value)]
    return args + adapters.serve_flags(spec) + list(runtime.extra_args)


def _frontends(spec: api.InferenceServiceSpec) -> int | None:
    """Frontend processes from the pod's CPU request, as `--api-server-count auto` decides from the CPUs it may use;
    None without a CPU request (the server decides from its own cgroup limit)."""
    cpu = ((spec.resources or {}).get("requests") or {}).get("cpu")
    cpus = cpu_quantity(cpu) if cpu is not None else None
    return None if cpus is None else frontends_for(cpus, accelerator=spec.accelerator.type != "cpu")


def _env(spec: api.InferenceServiceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
        {"name": "JAX_COMPILATION_CACHE_DIR", "value": f"{CACHE_MOUNT}/xla"},  # warm restarts skip compiling
    ]
    for var, ref in (("HF_TOKEN", spec.hf_token_secret), ("CAPSTAN_API_KEY", spec.api_key_secret)):
        if ref is not None:
            env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def _resources(spec: api.InferenceServiceSpec) -> dict[str, Any]:
    resources = copy.deepcopy(spec.resources or {})
    device = ACCELERATORS[spec.accelerator.type].resource
    if device:  # extended resources must be equal in requests and limits
        resources.setdefault("limits", {})[device] = spec.accelerator.count
        resources.setdefault("requests", {})[device] = spec.accelerator.count
    return resources


def _scheduling(spec: api.InferenceServiceSpec) -> dict[str, Any]:
    accelerator = ACCELERATORS[spec.accelerator.type]
    node_selector = dict(accelerator.node_labels)
    if is_tpu(spec.accelerator.type):
        assert spec.accelerator.topology is not None, "the CRD requires a TPU's topology"
        node_selector[TPU_TOPOLOGY_LABEL] = spec.accelerator.topology
    node_selector.update(spec.node_selector)
    tolerations = (
        [{"key": accelerator.taint_key, "operator": "Exists", "effect": "NoSchedule"}] if accelerator.taint_key else []
    )
    scheduling: dict[str, Any] = {"nodeSelector": node_selector, "tolerations": tolerations + list(spec.tolerations)}
    if spec.affinity:
        scheduling["affinity"] = spec.affinity
    return {k: v for k, v in scheduling.items() if v}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def render_pod_template(name: str, spec: api.InferenceServiceSpec) -> dict[str, Any]:
    source = model_source(spec.model.uri)
    lora = adapters.adapter_sources(spec)
    lora_config = [adapters.config_volume(name)] if spec.lora_enabled() else []
    lora_mount = [adapters.config_mount()] if spec.lora_enabled() else []
    claim = model_cache_claim_name(name, spec)
    cache_volume = {"name": "model-cache"} | (
        {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    )
    container = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": ["capstan", "serve"],
        "args": serve_args(spec, source.argument),
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": _resources(spec),
        # Ready only after download and warm-up compilation; the startup probe allows for both.
        "startupProbe": _probe("/ready", 10, math.ceil(spec.startup_timeout_seconds / 10)),
        "readinessProbe": _probe("/ready", 5, 2),
        "livenessProbe": _probe("/health", 10, 6),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        "securityContext": pod_security.container_security_context(spec.security.privileged),
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_MOUNT},
            pod_security.scratch_mount(),
            *source.mounts,
            *lora_mount,
            *lora.mounts,
        ],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "securityContext": pod_security.pod_security_context(),
        "volumes": [cache_volume, pod_security.scratch_volume(), *source.volumes, *lora_config, *lora.volumes],
        "terminationGracePeriodSeconds": PRESTOP_SECONDS + spec.drain_timeout_seconds + GRACE_MARGIN_SECONDS,
        "enableServiceLinks": False,
        **_scheduling(spec),
    }
    if source.init_containers or lora.init_containers:
        pod_spec["initContainers"] = source.init_containers + lora.init_containers
    template = {"metadata": {"labels": labels(name)}, "spec": pod_spec}
    return apply_pod_overrides(template, spec.pod_template)


def apply_pod_overrides(template: dict[str, Any], overrides: api.PodTemplateOverrides | None) -> dict[str, Any]:
    """Metadata maps merge; spec fields replace, except containers (fields merge by name) and volumes (replace by
    name), so that overriding one volume keeps the others the containers mount."""
    if overrides is None:
        return template
    merged = copy.deepcopy(template)
    meta = merged["metadata"]
    meta["labels"] = {**overrides.metadata.labels, **meta["labels"]}  # ours win: the selector depends on them
    if overrides.metadata.annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **overrides.metadata.annotations}
    for key, value in overrides.spec.items():
        if key not in ("containers", "volumes"):
            merged["spec"][key] = copy.deepcopy(value)
            continue
        ours = {item["name"]: item for item in merged["spec"].setdefault(key, [])}
        for item in value:
            if item.get("name") not in ours:
                merged["spec"][key].append(copy.deepcopy(item))
            elif key == "containers":
                ours[item["name"]].update(copy.deepcopy(item))
            else:
                ours[item["name"]].clear()
                ours[item["name"]].update(copy.deepcopy(item))
    return merged


def render_deployment(owner: dict[str, Any], spec: api.InferenceServiceSpec, replicas: int) -> dict[str, Any]:
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(name)},
            # Surge one new pod at a time and remove an old one only when the new one is ready.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": spec.startup_timeout_seconds + 300,
            "revisionHistoryLimit": 3,
            "template": render_pod_template(name, spec),
        },
    }


def render_service(owner: dict[str, Any], pod_selector: dict[str, str] | None = None) -> dict[str, Any]:
    """The OpenAI endpoint; pod_selector narrows it to the leaders of multi-host replicas."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": pod_selector or selector(name),
            "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pod_disruption_budget(owner: dict[str, Any]) -> dict[str, Any]:
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, owner),
        # One pod at a time: node drains make progress while the rest keep serving.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}},
    }


def render_model_cache_claim(owner: dict[str, Any], spec: api.InferenceServiceSpec) -> dict[str, Any] | None:
    """The PVC the operator owns when the spec asks for a cache by size (none for an existing claim)."""
    cache = spec.model_cache
    if cache is None or cache.size is None:
        return None
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    claim_spec: dict[str, Any] = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        claim_spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(name, namespace, owner, model_cache_claim_name(name, spec)),
        "spec": claim_spec,
    }


def render_adapters_configmap(owner: dict[str, Any], spec: api.InferenceServiceSpec) -> dict[str, Any] | None:
    """The --lora-modules-file every serving pod mounts; none without LoRA."""
    if not spec.lora_enabled():
        return None
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(name, namespace, owner, adapters.configmap_name(name)),
        "data": {adapters.MODULES_KEY: adapters.modules_json(spec)},
    }


def render_volume_sources(owner: dict[str, Any], spec: api.InferenceServiceSpec) -> list[dict[str, Any]]:
    """What the pods' volumes name, applied before the pods: the cache claim and the adapters' ConfigMap."""
    return [obj for obj in (render_model_cache_claim(owner, spec), render_adapters_configmap(owner, spec)) if obj]


def render_all(owner: dict[str, Any], spec: api.InferenceServiceSpec, replicas: int) -> list[dict[str, Any]]:
    """Every object the InferenceService owns, in the order they should be applied."""
    return [
        *render_volume_sources(owner, spec),
        render_service(owner),
        render_pod_disruption_budget(owner),
        render_deployment(owner, spec, replicas),
    ]
