"""Suite-wide: the test in progress written to a file, so a run killed by a signal (SIGABRT from native code, the
OOM killer) still names the test it was in; .ci/run prints it when `make test` fails."""

import contextlib
import os
from pathlib import Path

PROGRESS = Path(os.environ.get("TMPDIR", "/tmp")) / "capstan-test-progress"


def pytest_runtest_logstart(nodeid: str, location) -> None:
    with contextlib.suppress(OSError):  # a read-only or missing TMPDIR must not fail the suite
        PROGRESS.write_text(nodeid + "\n")
