"""LoRA adapters of an InferenceService: the list the servers read, and what the pods need to reach each source.

The list lives in a ConfigMap (NAME-adapters) mounted whole in every serving pod and passed as
`--lora-modules-file`: editing spec.adapters rewrites the ConfigMap, the kubelet rewrites the mounted file, and
the running server loads added adapters and unloads removed ones, with the pod template unchanged (no rollout).
What the pod template must carry is only what a source needs before the server can read it: a claim mounted for
pvc://, a download at pod start for gs:// and s3:// (so adding one of those rolls the pods); hf:// passes
through to the server, which downloads it as it does models.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from capstan.operator import api
from capstan.operator.model_source import (
    SOURCE_MOUNT,
    downloader_container,
    object_store_copy,
    parse_uri,
)

CONFIG_VOLUME = "adapters"
MOUNT = "/etc/capstan/adapters"  # the ConfigMap, whole: a subPath mount would never see an update
MODULES_KEY = "adapters.json"
MODULES_FILE = f"{MOUNT}/{MODULES_KEY}"
CLAIMS_MOUNT = "/mnt/adapters"  # pvc:// adapters' claims, read-only, one folder per claim
DOWNLOAD_CONTAINER = "adapter-download"
# One init container copies every gs:// and s3:// adapter; "$@" holds remote/local pairs.
DOWNLOAD_SCRIPT = 'while [ "$#" -gt 1 ]; do rclone copy --fast-list --transfers=16 "$1" "$2" || exit 1; shift 2; done'


@dataclass
class AdapterSources:
    modules: list[dict[str, str]]  # the --lora-modules-file: [{"name", "path"}], in spec order
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def configmap_name(name: str) -> str:
    return f"{name}-adapters"


def claim_volume_name(claim: str) -> str:
    """A volume name (a DNS label) for an adapter claim: readable when it fits, else a digest."""
    readable = f"adapters-{claim}"
    return readable if len(readable) <= 63 else f"adapters-{hashlib.sha256(claim.encode()).hexdigest()[:16]}"


def adapter_sources(spec: api.InferenceServiceSpec) -> AdapterSources:
    model_scheme, model_claim, _ = parse_uri(spec.model.uri)
    sources = AdapterSources(modules=[])
    claims: list[str] = []
    copies: dict[str, tuple[str, str]] = {}  # adapter name -> (remote, local)
    for adapter in spec.adapters:
        scheme, location, path = parse_uri(adapter.source)
        if scheme == "hf":
            local = adapter.source  # the server downloads it into HF_HOME, on the cache volume
        elif scheme == "pvc" and model_scheme == "pvc" and location == model_claim:
            local = f"{SOURCE_MOUNT}/{path}".rstrip("/")  # the model's claim is mounted already
        elif scheme == "pvc":
            if location not in claims:
                claims.append(location)
            local = f"{CLAIMS_MOUNT}/{location}/{path}".rstrip("/")
        else:
            remote, local = object_store_copy(adapter.source, "adapters")
            copies[adapter.name] = (remote, local)
        sources.modules.append({"name": adapter.name, "path": local})
    for claim in sorted(claims):  # sorted: the order of spec.adapters never changes the pod template
        volume = claim_volume_name(claim)
        sources.volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        sources.mounts.append({"name": volume, "mountPath": f"{CLAIMS_MOUNT}/{claim}", "readOnly": True})
    pairs = [part for _, pair in sorted(copies.items()) for part in pair]
    if pairs:
        sources.init_containers.append(
            downloader_container(DOWNLOAD_CONTAINER, [DOWNLOAD_SCRIPT, DOWNLOAD_CONTAINER, *pairs], ["sh", "-c"])
        )
    return sources


def modules_json(spec: api.InferenceServiceSpec) -> str:
    """The --lora-modules-file's content, as the ConfigMap carries it."""
    return json.dumps(adapter_sources(spec).modules, indent=2) + "\n"


def serve_flags(spec: api.InferenceServiceSpec) -> list[str]:
    """`capstan serve`'s LoRA flags (vLLM's); none without LoRA. They never depend on the adapters listed, so
    that editing the list leaves the pod template alone."""
    if not spec.lora_enabled():
        return []
    lora = spec.lora or api.LoraSpec()
    flags = ["--enable-lora", "--lora-modules-file", MODULES_FILE]
    for flag, value in (
        ("--max-loras", lora.max_loras),
        ("--max-lora-rank", lora.max_lora_rank),
        ("--max-cpu-loras", lora.max_cpu_loras),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def config_volume(name: str) -> dict[str, Any]:
    return {"name": CONFIG_VOLUME, "configMap": {"name": configmap_name(name)}}


def config_mount() -> dict[str, Any]:
    return {"name": CONFIG_VOLUME, "mountPath": MOUNT, "readOnly": True}
