"""Build the test cluster's binaries from their Go modules, once, into the user's cache folder.

kube-apiserver, kube-controller-manager and kube-scheduler come from `k8s.io/kubernetes` through a
wrapper module that pins each staging module `k8s.io/X v0.0.0` to its published `v0.N.M`; etcd from
`go.etcd.io/etcd/server/v3`; kwok from `sigs.k8s.io/kwok`; helm from `helm.sh/helm/v3`. The real node's
kubelet and kube-proxy come from the same wrapper module, its pod sandbox's `pause` from tests/cluster/pause.

    python3 tests/cluster/binaries.py        # build what is missing, print the folder
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.8"  # the etcd that k8s.io/kubernetes v1.36.3 itself requires
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.22.0"

# Lean builds: CI builds them on a fresh machine inside its time budget.
GO_FLAGS = ["-trimpath"]
GO_ENV = {"CGO_ENABLED": "0", "GOFLAGS": "-buildvcs=false"}


@dataclass(frozen=True)
class ClusterBinaries:
    folder: Path

    def __getitem__(self, name: str) -> Path:
        return self.folder / name


KUBE_COMMANDS = ["kube-apiserver", "kube-controller-manager", "kube-scheduler"]
NODE_COMMANDS = ["kubelet", "kube-proxy"]
ALL_BINARIES = KUBE_COMMANDS + NODE_COMMANDS + ["etcd", "kwok", "helm", "pause"]


def cache_folder() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = f"k8s-{KUBERNETES_VERSION}_etcd-{ETCD_VERSION}_kwok-{KWOK_VERSION}_helm-{HELM_VERSION}"
    return base / "capstan" / "k8s-bin" / tag


def ensure_binaries(log=print) -> ClusterBinaries:
    """Return the folder holding all binaries, building the missing ones first."""
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once: one builds, the other waits and reuses
        _build_missing(folder, log)
    return ClusterBinaries(folder)


def _build_missing(folder: Path, log) -> None:
    work = folder / "build"
    builds = [
        (KUBE_COMMANDS, _build_kubernetes),
        (["etcd"], _build_etcd),
        (["kwok"], _build_kwok),
        (["helm"], _build_helm),
        (NODE_COMMANDS, _build_node),
        (["pause"], _build_pause),
    ]
    for names, build in builds:
        if all((folder / n).exists() for n in names):
            continue
        started = time.monotonic()
        log(f"building {', '.join(names)} (once; cached in {folder})")
        build(work, folder)
        log(f"built {', '.join(names)} in {time.monotonic() - started:.0f}s")
    shutil.rmtree(work, ignore_errors=True)


def _go(args: list[str], cwd: Path) -> None:
    if not shutil.which("go"):
        raise RuntimeError("the cluster tests build Kubernetes from source and need Go (>= 1.26) on PATH")
    env = {**os.environ, **GO_ENV}
    subprocess.run(["go", *args], cwd=cwd, env=env, check=True)


def _wrapper_module(work: Path, name: str, go_mod: str) -> Path:
    module = work / name
    shutil.rmtree(module, ignore_errors=True)
    module.mkdir(parents=True)
    # A blank-import tools.go (written by the caller) keeps the commands' packages in the module graph.
    (module / "go.mod").write_text(go_mod)
    return module


def _ldflags(*stamps: str) -> str:
    return " ".join(["-s", "-w", *(f"-X {s}" for s in stamps)])


def _build(module: Path, out: Path, packages: list[str], ldflags: str) -> None:
    partial = out / ".partial"
    partial.mkdir(exist_ok=True)
    _go(["build", "-mod=mod", *GO_FLAGS, "-ldflags", ldflags, "-o", f"{partial}/", *packages], module)
    for f in partial.iterdir():
        f.replace(out / f.name)  # moved in last, so a half-built set is never mistaken for the cache
    partial.rmdir()


def _staging_modules(go_mod_text: str) -> list[str]:
    return sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+) v0\.0\.0\s*$", go_mod_text, flags=re.M)))


def _build_kubernetes(work: Path, out: Path, commands: list[str] = KUBE_COMMANDS) -> None:
    work.mkdir(parents=True, exist_ok=True)
    mod_path = subprocess.run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
        cwd=work,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **GO_ENV},
    ).stdout
    found = re.search(r'"GoMod":\s*"([^"]+)"', mod_path)
    assert found is not None, f"go mod download -json named no GoMod: {mod_path[:500]}"
    go_mod_file = found.group(1)  # k8s.io/kubernetes's own go.mod
    staging = _staging_modules(Path(go_mod_file).read_text())
    published = "v0." + KUBERNETES_VERSION.removeprefix("v1.")
    lines = [
        "module capstan.dev/testcluster/kubernetes",
        "",
        "go 1.26",
        "",
        f"require k8s.io/kubernetes {KUBERNETES_VERSION}",
        "",
        "replace (",
        *(f"\t{m} => {m} {published}" for m in staging),
        ")",
        "",
    ]
    module = _wrapper_module(work, "kubernetes", "\n".join(lines))
    major, minor = KUBERNETES_VERSION.removeprefix("v").split(".")[:2]
    stamps = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        stamps += [
            f"{pkg}.gitVersion={KUBERNETES_VERSION}",
            f"{pkg}.gitMajor={major}",
            f"{pkg}.gitMinor={minor}",
            f"{pkg}.gitTreeState=clean",
            f"{pkg}.buildDate=1970-01-01T00:00:00Z",
        ]
    (module / "tools.go").write_text(
        "package tools\n\nimport (\n" + "".join(f'\t_ "k8s.io/kubernetes/cmd/{c}/app"\n' for c in commands) + ")\n"
    )
    # One `go build` for all three commands shares the compilation of their common packages.
    _build(module, out, [f"k8s.io/kubernetes/cmd/{c}" for c in commands], _ldflags(*stamps))


def _build_node(work: Path, out: Path) -> None:
    """kubelet and kube-proxy: a second build so that a cache holding the control plane only completes it."""
    _build_kubernetes(work, out, NODE_COMMANDS)


def _build_pause(work: Path, out: Path) -> None:
    source = Path(__file__).resolve().parent / "pause"
    _build_single(source, out, ".", "pause", _ldflags())


def _build_etcd(work: Path, out: Path) -> None:
    module = _wrapper_module(
        work,
        "etcd",
        f"module capstan.dev/testcluster/etcd\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 {ETCD_VERSION}\n",
    )
    (module / "tools.go").write_text('package tools\n\nimport _ "go.etcd.io/etcd/server/v3/etcdmain"\n')
    _build_single(module, out, "go.etcd.io/etcd/server/v3", "etcd", _ldflags())


def _build_kwok(work: Path, out: Path) -> None:
    module = _wrapper_module(
        work, "kwok", f"module capstan.dev/testcluster/kwok\n\ngo 1.26\n\nrequire sigs.k8s.io/kwok {KWOK_VERSION}\n"
    )
    (module / "tools.go").write_text('package tools\n\nimport _ "sigs.k8s.io/kwok/pkg/kwok/cmd"\n')
    _build_single(
        module,
        out,
        "sigs.k8s.io/kwok/cmd/kwok",
        "kwok",
        _ldflags(f"sigs.k8s.io/kwok/pkg/consts.Version={KWOK_VERSION}"),
    )


def _build_helm(work: Path, out: Path) -> None:
    module = _wrapper_module(
        work, "helm", f"module capstan.dev/testcluster/helm\n\ngo 1.26\n\nrequire helm.sh/helm/v3 {HELM_VERSION}\n"
    )
    (module / "tools.go").write_text('package tools\n\nimport _ "helm.sh/helm/v3/pkg/action"\n')
    major, minor = KUBERNETES_VERSION.removeprefix("v").split(".")[:2]
    _build_single(
        module,
        out,
        "helm.sh/helm/v3/cmd/helm",
        "helm",
        _ldflags(
            f"helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
            "helm.sh/helm/v3/internal/version.gitTreeState=clean",
            # Offline (lint, template) Helm assumes this Kubernetes, not its default v1.20.
            f"helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor={major}",
            f"helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={minor}",
            f"helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor={major}",
            f"helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor={minor}",
        ),
    )


def _build_single(module: Path, out: Path, package: str, name: str, ldflags: str) -> None:
    partial = out / f".{name}.partial"
    _go(["build", "-mod=mod", *GO_FLAGS, "-ldflags", ldflags, "-o", str(partial), package], module)
    partial.replace(out / name)


if __name__ == "__main__":
    started = time.monotonic()
    binaries = ensure_binaries(log=lambda m: print(m, file=sys.stderr, flush=True))
    print(binaries.folder)
    print(f"all binaries ready in {time.monotonic() - started:.0f}s", file=sys.stderr)
