"""What the built image promises a cluster: its name and version, a non-root user, a command that needs no
shell, writable places only under /tmp, and a second build of the same tree served from the cache."""

from __future__ import annotations

import json
import tarfile
import time

import pytest
from build import USER_ID, build_image, package_version

pytestmark = pytest.mark.realnode


def blob(tar: tarfile.TarFile, digest: str) -> dict:
    member = tar.extractfile(f"blobs/{digest.replace(':', '/')}")
    assert member is not None, f"no blob {digest}"
    return json.load(member)


def test_the_image_runs_capstan_as_a_non_root_user_with_no_shell(image):
    archive, reference = image
    assert reference == f"localhost/capstan:{package_version()}"
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))
        manifest = blob(tar, index["manifests"][0]["digest"])
        config = blob(tar, manifest["config"]["digest"])["config"]
    assert index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == reference
    assert len(manifest["layers"]) == 2  # the cached base, and Capstan's own small layer on top
    assert config["User"] == f"{USER_ID}:{USER_ID}"
    assert config["Cmd"] == ["capstan", "serve"] and not config.get("Entrypoint")  # exec form: no shell
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["HOME"] == "/tmp" and env["XDG_CACHE_HOME"].startswith("/tmp/")
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["PATH"].startswith("/opt/capstan/bin")
    assert config["Labels"]["org.opencontainers.image.version"] == package_version()


def test_a_second_build_of_the_same_tree_is_the_cached_one(image):
    started = time.monotonic()
    assert build_image("cpu") == image
    assert time.monotonic() - started < 5
