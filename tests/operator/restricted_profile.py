"""The `restricted` Pod Security Standard's checks, written from its table
(https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted) independently of the operator's
render code, so that unit tests can hold every rendered kind of pod to it."""

from __future__ import annotations

from typing import Any

ALLOWED_VOLUMES = {
    "emptyDir",
    "persistentVolumeClaim",
    "configMap",
    "secret",
    "projected",
    "downwardAPI",
    "ephemeral",
    "csi",
}


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """What keeps a pod spec out of the `restricted` profile; empty when it passes."""
    problems = []
    pod = pod_spec.get("securityContext") or {}
    if pod.get("runAsUser") == 0:
        problems.append("securityContext.runAsUser is 0 (root)")
    for kind in ("initContainers", "containers"):
        for container in pod_spec.get(kind, []):
            where = f"{kind}[{container['name']}].securityContext"
            context = container.get("securityContext") or {}
            if not (context.get("runAsNonRoot", pod.get("runAsNonRoot"))):
                problems.append(f"{where}.runAsNonRoot is not true (nor the pod's)")
            if context.get("runAsUser", pod.get("runAsUser")) == 0:
                problems.append(f"{where}.runAsUser is 0 (root)")
            seccomp = (context.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                problems.append(f"{where}.seccompProfile.type is {seccomp!r}, not RuntimeDefault or Localhost")
            if context.get("privileged"):
                problems.append(f"{where}.privileged is true")
            if context.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}.allowPrivilegeEscalation is not false")
            capabilities = context.get("capabilities") or {}
            if "ALL" not in capabilities.get("drop", []):
                problems.append(f"{where}.capabilities.drop does not include ALL")
            if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
                problems.append(f"{where}.capabilities.add has more than NET_BIND_SERVICE")
            if not context.get("readOnlyRootFilesystem"):  # not in the profile: our own hardening, held alike
                problems.append(f"{where}.readOnlyRootFilesystem is not true")
    for volume in pod_spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if kinds - ALLOWED_VOLUMES:
            problems.append(f"volumes[{volume['name']}] is {sorted(kinds)}: not a volume type the profile allows")
    return problems
