"""Where a pod finds its weights: the model URI turned into `capstan serve`'s MODEL argument, plus the
volumes and the download step that URI needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capstan.operator import pod_security

CACHE_MOUNT = "/var/cache/capstan"  # weights, Hugging Face downloads and XLA's compilation cache
SOURCE_MOUNT = "/mnt/models"  # a pvc:// model, read-only
DOWNLOADER_IMAGE = "rclone/rclone:1.69"  # one tool for gs:// and s3://, incremental into the cache


@dataclass
class ModelSource:
    argument: str  # what `capstan serve` gets as MODEL
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def parse_uri(uri: str) -> tuple[str, str, str]:
    """'pvc://claim/a/b' -> ('pvc', 'claim', 'a/b')."""
    scheme, _, rest = uri.partition("://")
    location, _, path = rest.partition("/")
    return scheme, location, path


def served_model_name(uri: str) -> str:
    """The name clients send when the spec names none: org/name for hf://, else the last path part."""
    scheme, location, path = parse_uri(uri)
    if scheme == "hf":
        return f"{location}/{path.split('@')[0]}"
    return (path.rstrip("/").split("/")[-1]) or location


def model_source(uri: str) -> ModelSource:
    scheme, location, path = parse_uri(uri)
    if scheme == "hf":
        return ModelSource(uri)  # the runtime downloads it into HF_HOME, on the cache volume
    if scheme == "pvc":
        return ModelSource(
            f"{SOURCE_MOUNT}/{path}".rstrip("/"),
            volumes=[{"name": "model-source", "persistentVolumeClaim": {"claimName": location, "readOnly": True}}],
            mounts=[{"name": "model-source", "mountPath": SOURCE_MOUNT, "readOnly": True}],
        )
    assert scheme in ("gs", "s3"), f"the CRD's pattern admits no scheme {scheme!r}"
    remote, local = object_store_copy(uri, "models")
    download = downloader_container("model-download", ["copy", "--fast-list", "--transfers=16", remote, local])
    return ModelSource(local, init_containers=[download])


def object_store_copy(uri: str, folder: str) -> tuple[str, str]:
    """gs:// or s3:// -> (rclone's remote, the folder under the cache volume it is copied to)."""
    scheme, location, path = parse_uri(uri)
    local = f"{CACHE_MOUNT}/{folder}/{scheme}/{location}/{path}".rstrip("/")
    remote = f":{'gcs' if scheme == 'gs' else 's3'}:{location}/{path}".rstrip("/")
    return remote, local


def downloader_container(name: str, args: list[str], command: list[str] | None = None) -> dict[str, Any]:
    """An rclone init container writing into the cache volume, restricted like every container we render."""
    container: dict[str, Any] = {"name": name, "image": DOWNLOADER_IMAGE}
    if command:
        container["command"] = command
    return container | {
        "args": args,
        # Credentials come from the pod's identity (workload identity, IRSA) or env the user adds.
        "env": [
            {"name": "RCLONE_GCS_ENV_AUTH", "value": "true"},
            {"name": "RCLONE_S3_ENV_AUTH", "value": "true"},
            {"name": "RCLONE_S3_PROVIDER", "value": "AWS"},
            {"name": "HOME", "value": pod_security.SCRATCH_MOUNT},
        ],  # rclone's config and cache, off the read-only root
        "securityContext": pod_security.container_security_context(),
        "volumeMounts": [{"name": "model-cache", "mountPath": CACHE_MOUNT}, pod_security.scratch_mount()],
    }
