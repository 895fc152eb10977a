"""Asynchronous scheduling (the GPUs' default) behind the OpenAI API: a real uvicorn server on 127.0.0.1 and the
openai client, against the session's synchronous server on the same checkpoint. Steps with prompt tokens are queued
while the step before runs (counted on the engine), answers are the synchronous server's, concurrent streams all
finish, and a client that leaves while its token is unread gives its pages back."""

from __future__ import annotations

import threading

import openai
import pytest
from servers import CHECKPOINT, ENGINE_FLAGS, MODEL, START_TIMEOUT, ThreadServer
from test_disconnect import ABORTED, wait_pages_held, wait_pool_free

from capstan.runtime.config import EngineConfig

pytestmark = pytest.mark.slow
QUESTIONS = ["Hello there", "What is the capital of France?", "Count to five", "Name a colour"]


@pytest.fixture(scope="module")
def queued():
    """The server with asynchronous scheduling on, and the count of its engine's queued steps."""
    from capstan.runtime.engine.async_llm import AsyncLLM
    from capstan.runtime.server.app import build_app, make_context

    llm = AsyncLLM(EngineConfig(model=str(CHECKPOINT), **ENGINE_FLAGS, async_scheduling=True))
    assert llm.wait_ready(START_TIMEOUT), "warm-up did not finish"
    engine, count = llm.engine, []
    step_async = engine._step_async

    def counted(*args, **kwargs):  # instruments the real method: how many steps went the queued way
        count.append(1)
        return step_async(*args, **kwargs)

    engine._step_async = counted
    with ThreadServer(build_app(make_context(llm))) as s:
        yield s.url, count
    llm.shutdown()


@pytest.fixture(scope="module")
def slow_queued():
    """Asynchronous scheduling with one decode step a dispatch and a long context, as test_disconnect's server: a
    900-token answer lasts seconds, so the client surely leaves before its end."""
    from capstan.runtime.engine.async_llm import AsyncLLM
    from capstan.runtime.server.app import build_app, make_context

    config = EngineConfig(
        model=str(CHECKPOINT), **{**ENGINE_FLAGS, "max_model_len": 1024}, decode_steps=1, async_scheduling=True
    )
    llm = AsyncLLM(config)
    assert llm.wait_ready(START_TIMEOUT), "warm-up did not finish"
    with ThreadServer(build_app(make_context(llm))) as s:
        yield s.url
    llm.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def ask(url: str, question: str, **params) -> tuple[str, list]:
    """The answer, and its tokens' logprobs where asked: (token, logprob, the top alternatives' tokens)."""
    r = client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, **params
    )
    choice = r.choices[0]
    positions = choice.logprobs.content if choice.logprobs else []
    return choice.message.content, [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in positions]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0},
        {"temperature": 0.8, "top_p": 0.9, "seed": 7},
        {"temperature": 0, "frequency_penalty": 1.0, "presence_penalty": 0.5},  # the penalized program
        {"temperature": 0.8, "seed": 3, "logprobs": True, "top_logprobs": 2},  # read when the step settles
    ],
)
def test_each_answer_is_the_synchronous_servers(queued, server, params):
    url, count = queued
    before = len(count)
    for q in QUESTIONS:
        (text, logprobs), (want_text, want_logprobs) = ask(url, q, **params), ask(server, q, **params)
        assert text == want_text
        assert [(t, top) for t, _, top in logprobs] == [(t, top) for t, _, top in want_logprobs]
        assert [lp for _, lp, _ in logprobs] == pytest.approx([lp for _, lp, _ in want_logprobs], abs=1e-5)
        assert bool(logprobs) == bool(params.get("logprobs"))
    assert len(count) > before, "no step was queued while the one before ran"


def test_concurrent_streams_all_finish_with_their_usage(queued):
    url, _ = queued
    results: dict[int, tuple] = {}

    def stream(i: int) -> None:
        chunks = client(url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " " * i}],
            max_tokens=16 + i,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.7,
            seed=i,
        )
        text, finish, usage = "", None, None
        for c in chunks:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            usage = c.usage or usage
        results[i] = (finish, usage)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == list(range(8)), "a stream did not finish"
    for i, (finish, usage) in results.items():
        assert finish in ("stop", "length")
        assert 0 < usage.completion_tokens <= 16 + i
    wait_pool_free(url)


def test_a_client_leaving_mid_stream_gives_its_pages_back(slow_queued):
    url = slow_queued
    aborted = wait_pool_free(url)[ABORTED]
    chunks = client(url).completions.create(
        model=MODEL,
        prompt="tell me a long story " * 8,
        max_tokens=900,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    next(iter(chunks))
    wait_pages_held(url)
    chunks.close()
    assert wait_pool_free(url)[ABORTED] == aborted + 1
    assert ask(url, QUESTIONS[0], temperature=0) == ask(url, QUESTIONS[0], temperature=0)
