"""The official openai client (sync, async, streaming) against the real server, as an application uses it."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from servers import MODEL

pytestmark = pytest.mark.slow
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_stream_matches_the_whole_response(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completion_prompt_forms_and_n(client):
    r = client.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=3, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    by_ids = client.completions.create(model=MODEL, prompt=[11, 12, 13], max_tokens=3)
    assert by_ids.usage.prompt_tokens == 3
    batches = client.completions.create(model=MODEL, prompt=[[11, 12], [13, 14, 15]], max_tokens=2)
    assert batches.usage.prompt_tokens == 5 and len(batches.choices) == 2


def test_completion_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, logprobs=2, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith("Hello there")
    lp = choice.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + 3 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[: r.usage.prompt_tokens]) == "Hello there"


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL, prompt="The sea", max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_stop_string_ends_with_stop(client):
    text = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0).choices[0].text
    stop = text[2:4]
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text


def test_sampling_extras_are_accepted(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=4,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"7": 5},
        user="team-a",
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2},
    )
    assert r.usage.completion_tokens == 4


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6


def test_chat_stream(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_chat_content_parts_and_logprobs(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True, top_logprobs=3, n=2)
    assert len(r.choices) == 2
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_chat_stops_at_end_of_turn(client, engine):
    # ignore_eos off: the end-of-turn token (<|im_end|>) is favoured by a logit bias, so the turn ends at once.
    end = engine.tokenizer.token_to_id("<|im_end|>")
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, logit_bias={str(end): 100})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    assert r.usage.completion_tokens == 1


def test_async_client_concurrent_streams(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> str:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=8, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        texts = await asyncio.gather(*(one(i) for i in range(6)))
        await client.close()
        return texts

    assert len(asyncio.run(main())) == 6


def test_metrics_count_finished_requests(client, server):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "capstan_requests_running",
        "capstan_kv_cache_usage_ratio",
        "capstan_prefix_cache_hit_rate",
        "capstan_time_to_first_token_seconds_bucket",
        "capstan_inter_token_latency_seconds_bucket",
        "capstan_e2e_request_latency_seconds_count",
        "capstan_generation_tokens_total",
        'capstan_requests_finished_total{finish_reason="length"}',
    ):
        assert name in text, name
