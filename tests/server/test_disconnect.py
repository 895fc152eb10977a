"""A client that goes away mid-request aborts it: its KV pages return to the pool (read from /metrics)."""

from __future__ import annotations

import time

import httpx
import pytest
from servers import CHECKPOINT, ENGINE_FLAGS, MODEL, START_TIMEOUT, ThreadServer

from capstan.runtime.config import EngineConfig

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


def wait_pages_held(url: str, timeout: float = 10) -> None:
    """Until /metrics shows the streaming request's pages taken (its stats may trail the first token a step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = gauges(url)
        if g["capstan_kv_pages_free"] < g["capstan_kv_pages_total"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"no KV pages held within {timeout} s of the first token: {gauges(url)}")


@pytest.fixture(scope="module")
def slow_server():
    """One decode step per dispatch and a long context: a 900-token answer lasts seconds, whatever the machine."""
    from capstan.runtime.engine.async_llm import AsyncLLM
    from capstan.runtime.server.app import build_app, make_context

    engine = AsyncLLM(EngineConfig(model=str(CHECKPOINT), **{**ENGINE_FLAGS, "max_model_len": 1024}, decode_steps=1))
    assert engine.wait_ready(START_TIMEOUT)
    with ThreadServer(build_app(make_context(engine))) as s:
        yield s.url
    engine.shutdown()


def test_stream_disconnect_frees_pages(slow_server):
    aborted = wait_pool_free(slow_server)[ABORTED]
    body = {**LONG, "prompt": "tell me a long story " * 8, "max_tokens": 900, "stream": True}
    with httpx.stream("POST", f"{slow_server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        wait_pages_held(slow_server)
    # Leaving the block closed the connection long before 900 tokens.
    assert wait_pool_free(slow_server)[ABORTED] == aborted + 1


def test_non_streaming_disconnect_frees_pages(slow_server):
    aborted = wait_pool_free(slow_server)[ABORTED]
    body = {**LONG, "messages": [{"role": "user", "content": "a long answer please"}], "max_tokens": 900}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_server}/v1/chat/completions", json=body, timeout=0.5)
    assert wait_pool_free(slow_server)[ABORTED] == aborted + 1
