"""A client that goes away mid-request aborts it: its KV pages return to the pool (read from /metrics)."""
from __future__ import annotations

import time

import httpx
import pytest

from servers import MODEL

pytestmark = pytest.mark.slow
LONG = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def gauges(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


ABORTED = 'capstan_requests_finished_total{finish_reason="abort"}'


def wait_pool_free(url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = gauges(url)
        if g["capstan_requests_running"] == 0 and g["capstan_kv_pages_free"] == g["capstan_kv_pages_total"]:
            return g
        time.sleep(0.1)
    raise AssertionError(f"KV pages not returned within {timeout} s: {gauges(url)}")


def test_stream_disconnect_frees_pages(server):
    aborted = wait_pool_free(server)[ABORTED]
    body = {**LONG, "prompt": "tell me a long story " * 8, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        busy = gauges(server)
        assert busy["capstan_kv_pages_free"] < busy["capstan_kv_pages_total"]
    # Leaving the block closed the connection long before 400 tokens.
    assert wait_pool_free(server)[ABORTED] == aborted + 1


def test_non_streaming_disconnect_frees_pages(server):
    aborted = wait_pool_free(server)[ABORTED]
    body = {**LONG, "messages": [{"role": "user", "content": "a long answer please"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/chat/completions", json={**body, "max_tokens": 480}, timeout=0.5)
    assert wait_pool_free(server)[ABORTED] == aborted + 1
