"""`capstan serve` answers before every step program is compiled: /ready once the first request's programs are,
`capstan_programs_compiling` counts the rest down while requests are served, and the answers are the same after."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from servers import MODEL, ServeProcess

pytestmark = pytest.mark.slow
BACKGROUND_TIMEOUT = 600  # seconds for every other program to compile, on a busy 2-core machine
QUESTION = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Hello there"}],
    "max_tokens": 24,
    "temperature": 0,
}


def compiling(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^capstan_programs_compiling (\S+)$", text, re.M)
    assert found is not None, "no capstan_programs_compiling gauge in /metrics"
    return float(found.group(1))


def test_a_request_is_answered_while_programs_compile_and_the_same_after(tmp_path):
    # a compilation cache of its own, empty: the programs cannot come from an earlier run's
    with ServeProcess(env={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}) as server:
        assert compiling(server.url) > 0
        during = httpx.post(f"{server.url}/v1/chat/completions", json=QUESTION, timeout=120)
        assert during.status_code == 200, during.text
        assert compiling(server.url) > 0, "every program compiled before the request was answered"
        deadline = time.monotonic() + BACKGROUND_TIMEOUT
        while compiling(server.url) > 0:
            assert time.monotonic() < deadline, "the background compilation did not end"
            time.sleep(0.5)
        after = httpx.post(f"{server.url}/v1/chat/completions", json=QUESTION, timeout=120)
        assert after.json()["choices"][0]["message"] == during.json()["choices"][0]["message"]
        log = "".join(server.output)
        assert "more compile in the background while serving" in log
        assert "background compilation done" in log
