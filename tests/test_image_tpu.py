"""The packed TPU image of this tree (`make image-tpu`) passes image/tpu_check.py in its own root filesystem, as its
user with its environment: its Python imports jax, jax finds libtpu's plugin, loads it and compiles for a TPU v5e
slice (a sharded matmul, and the runtime's ragged paged-attention kernel through Mosaic).

No TPU is here; the build runs the same check before packing, this test runs it in the archive that ships. Skipped
where this tree's TPU image is not built: CI builds only the CPU image (the TPU one adds libtpu, 210 MB of download).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "image"))

from build import IMAGE_CHECKS, cache_root, image_hash, image_reference, run_image_check  # noqa: E402

UNPACK_TIMEOUT_SECONDS = 300


@pytest.fixture(scope="module")
def tpu_archive() -> Path:
    if os.geteuid() != 0 or not (shutil.which("umoci") and shutil.which("skopeo") and shutil.which("chroot")):
        pytest.skip("unpacking the image and running in it need root, umoci, skopeo and chroot")
    archive = cache_root() / f"tpu-{image_hash('tpu')}" / "capstan-tpu.oci.tar"
    if not archive.exists():
        pytest.skip("this tree's TPU image is not built: `make image-tpu` (not in CI)")
    return archive


def member_json(tar: tarfile.TarFile, name: str) -> dict:
    member = tar.extractfile(name)
    assert member is not None, f"{name}: not in the archive"
    return json.load(member)


def image_config(archive: Path) -> dict:
    with tarfile.open(archive) as tar:
        index = member_json(tar, "index.json")
        blob = lambda digest: member_json(tar, f"blobs/{digest.replace(':', '/')}")  # noqa: E731
        manifest = blob(index["manifests"][0]["digest"])
        return {
            "reference": index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
            "layers": len(manifest["layers"]),
            **blob(manifest["config"]["digest"])["config"],
        }


def test_the_tpu_image_finds_libtpu_and_compiles_for_a_tpu_slice(tpu_archive, tmp_path):
    config = image_config(tpu_archive)
    assert config["reference"] == image_reference("tpu") and image_reference("tpu").endswith("-tpu")
    assert config["layers"] == 2
    layout, bundle = tmp_path / "oci", tmp_path / "bundle"
    try:
        subprocess.run(
            ["skopeo", "copy", "--quiet", f"oci-archive:{tpu_archive}", f"oci:{layout}:check"],
            check=True,
            timeout=UNPACK_TIMEOUT_SECONDS,
        )
        subprocess.run(
            ["umoci", "unpack", "--image", f"{layout}:check", str(bundle)], check=True, timeout=UNPACK_TIMEOUT_SECONDS
        )
        result = run_image_check(bundle / "rootfs", IMAGE_CHECKS["tpu"], config["User"], config["Env"])
    finally:  # 2.5 GiB that pytest would keep for three runs
        shutil.rmtree(layout, ignore_errors=True)
        shutil.rmtree(bundle, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr
    findings = json.loads(result.stdout)
    assert findings["jax"] == "0.10.2" and findings["libtpu"].startswith("0.0.42")
    assert findings["library"].startswith("/opt/capstan/lib/python3.11/site-packages/libtpu/")
    assert findings["device_kind"] == "TPU v5 lite" and findings["matmul_partitions"] == 8
    assert findings["ragged_attention"] == "tpu_custom_call"
