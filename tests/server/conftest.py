"""Fixtures: one engine on the tiny golden Qwen3 checkpoint for the whole session, served in-process on
127.0.0.1 twice: open, and with API keys; and `capstan serve` with no model and no flags (the README's quick start),
one process for every module that asks the default model (its warm-up is minutes on a 2-core machine)."""

from __future__ import annotations

import pytest
from servers import API_KEYS, CHECKPOINT, ENGINE_FLAGS, MODEL, START_TIMEOUT, ServeProcess, ThreadServer

from capstan.runtime.config import EngineConfig


@pytest.fixture(scope="session")
def engine():
    from capstan.runtime.engine.async_llm import AsyncLLM

    llm = AsyncLLM(EngineConfig(model=str(CHECKPOINT), **ENGINE_FLAGS))
    assert llm.wait_ready(START_TIMEOUT), "warm-up did not finish"
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def server(engine):
    """The open server: base URL of an app without API keys."""
    from capstan.runtime.server.app import build_app, make_context

    with ThreadServer(build_app(make_context(engine), max_body_bytes=64 * 1024)) as s:
        yield s.url


@pytest.fixture(scope="session")
def keyed_server(engine):
    from capstan.runtime.server.app import build_app, make_context

    with ThreadServer(build_app(make_context(engine, ["served-name", MODEL]), api_keys=API_KEYS)) as s:
        yield s.url


@pytest.fixture(scope="session")
def default_model_server():
    """`capstan serve` as the README's quick start runs it: no model (SmolLM2-135M-Instruct), no flags."""
    with ServeProcess(model=None, engine_flags={}) as server:
        yield server
