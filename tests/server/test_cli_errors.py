"""`capstan serve` refusing what it cannot serve: a flag out of range is a CLI error (exit 2) naming the flag, and an
engine that cannot start (a setting the model or the devices refuse, found only once the engine core loads the
model) ends the server with exit 1 and the reason, as vLLM's does, rather than a server answering 503 forever."""

from __future__ import annotations

import subprocess
import sys

import pytest
from servers import CHECKPOINT, free_port

pytestmark = pytest.mark.slow


def serve(*flags: str, timeout: float = 180) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "capstan.runtime.cli", "serve", str(CHECKPOINT), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--port", "99999"], "argument --port: a port is between 0 and 65535, got 99999"),
        (["--max-num-batched-tokens", str(2**63)], f"max_num_batched_tokens must be at most 1048576, got {2**63}"),
        (["--max-num-seqs", str(2**63)], "max_num_seqs must be at most 65536"),
        (["--page-size", str(2**40)], "page_size must be at most 1024"),
        (["--decode-steps", str(2**40)], "decode_steps must be at most 256"),
        (["--max-model-len", str(2**63)], "max_model_len must be at most 16777216"),
        (["--api-server-count", str(2**63)], f"--api-server-count must be between 1 and 64, got {2**63}"),
        (["--api-server-count", "some"], "argument --api-server-count: a count of at least 1 or auto, got 'some'"),
        (
            ["--ssl-keyfile", str(CHECKPOINT / "config.json"), "--ssl-certfile", "/nonexistent/cert.pem"],
            "--ssl-certfile /nonexistent/cert.pem: no such file",
        ),
        (
            ["--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile", str(CHECKPOINT / "config.json")],
            "--ssl-keyfile /nonexistent/key.pem: no such file",
        ),
    ],
)
def test_a_flag_out_of_range_is_a_cli_error_naming_it(flags, says):
    out = serve(*flags, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--max-model-len", "100000"], "max_model_len (100000) is more than the model's context"),
        (["--num-pages", str(2**31 - 1)], "num_pages (2147483647) needs"),
    ],
)
def test_an_engine_that_cannot_start_ends_the_server_with_the_reason(flags, says):
    out = serve("--port", str(free_port()), *flags)
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"the engine could not start: {says}" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
