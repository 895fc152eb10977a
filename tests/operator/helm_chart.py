"""The chart rendered by `helm template` (no cluster), for the tests of what it renders."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from binaries import cache_folder  # tests/cluster is on the path (tests/operator/conftest.py)

CHART = Path(__file__).parents[2] / "charts" / "capstan"
HELM = cache_folder() / "helm"
needs_helm = pytest.mark.skipif(not HELM.exists(), reason="helm not built yet: python3 tests/cluster/binaries.py")


def template(*flags: str) -> list[dict]:
    out = subprocess.run(
        [str(HELM), "template", "capstan", str(CHART), "--namespace", "capstan-system", *flags],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]
