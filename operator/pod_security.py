"""Pod Security: every pod the operator renders passes the `restricted` Pod Security Standard
(https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted), so namespaces labelled
`pod-security.kubernetes.io/enforce: restricted` admit them.

The containers run as the image's user, without privilege escalation or capabilities, under the runtime's
default seccomp profile, on a read-only root filesystem; what they write goes to volumes: the model cache
(weights, Hugging Face downloads, XLA's compilation cache) and an emptyDir at /tmp (the image's HOME, Triton's
and other caches, temporary files). Only `spec.security.privileged` steps outside the profile
(docs/inferenceservice.md#security says when an accelerator needs it and which namespace level that takes).
"""

from __future__ import annotations

from typing import Any

RUNTIME_USER = 65532  # the image's uid and gid (image/build.py USER_ID), and the chart's
SCRATCH_VOLUME = "tmp"
SCRATCH_MOUNT = "/tmp"  # the image's HOME and XDG_CACHE_HOME live under it


def pod_security_context() -> dict[str, Any]:
    """Pod-wide: non-root as the image's user; volumes group-owned by it so a PVC cache is writable."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_USER,
        "runAsGroup": RUNTIME_USER,
        "fsGroup": RUNTIME_USER,
        "fsGroupChangePolicy": "OnRootMismatch",  # a cache of many large files is not chowned on every start
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(privileged: bool = False) -> dict[str, Any]:
    """Per container: nothing to escalate to, no capabilities, nothing written outside the volumes."""
    if privileged:  # asked for explicitly by the spec: the namespace must allow the `privileged` level
        return {"privileged": True, "readOnlyRootFilesystem": True}
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def scratch_volume() -> dict[str, Any]:
    return {"name": SCRATCH_VOLUME, "emptyDir": {}}


def scratch_mount() -> dict[str, Any]:
    return {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT}
