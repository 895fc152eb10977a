"""The cluster test's binaries are built (once, then cached) before any test runs, outside the per-test timeout, as
tests/operator/conftest.py does for its own; a second call finds them cached."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

from binaries import ensure_binaries  # noqa: E402


def pytest_collection_finish(session):
    if any(item.get_closest_marker("cluster") for item in session.items):
        try:
            ensure_binaries(log=lambda message: print(f"\n[capstan cluster] {message}", flush=True))
        except Exception as error:  # noqa: BLE001 - the test's fixture raises it again, failing that test only
            print(f"\n[capstan cluster] building the test cluster failed: {error}", flush=True)
