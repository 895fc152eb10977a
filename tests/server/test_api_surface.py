"""The rest of the OpenAI surface applications rely on, through the openai client against the real server:
max_completion_tokens, stream usage, chat logprobs, n > 1 streaming, and echo with max_tokens 0 (lm-eval's
loglikelihood requests), whose prompt logprobs are checked against transformers' golden logits."""

from __future__ import annotations

import collections
import json

import numpy as np
import openai
import pytest
from servers import CHECKPOINT, MODEL

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_max_completion_tokens_caps_chat(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_chat_stream_usage_comes_last(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_chat_logprobs_with_top_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for position in content:
        assert len(position.top_logprobs) == 3 and position.logprob <= 0
        assert position.top_logprobs[0].token == position.token  # greedy: the chosen token is the top one
        assert [t.logprob for t in position.top_logprobs] == sorted(
            (t.logprob for t in position.top_logprobs), reverse=True
        )


def collect(chunks, text_of) -> tuple[dict[int, str], dict[int, str]]:
    texts: collections.defaultdict[int, str] = collections.defaultdict(str)
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += text_of(choice) or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return dict(texts), reasons


def test_chat_n_streams_every_choice(client):
    kwargs = dict(
        model=MODEL, messages=CHAT, n=3, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    whole = client.chat.completions.create(**kwargs)
    texts, reasons = collect(client.chat.completions.create(stream=True, **kwargs), lambda c: c.delta.content)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}


def test_completion_n_streams_every_choice_of_every_prompt(client):
    kwargs = dict(
        model=MODEL,
        prompt=["Once upon", "The sea"],
        n=2,
        max_tokens=5,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs)
    texts, reasons = collect(client.completions.create(stream=True, **kwargs), lambda c: c.text)
    assert texts == {c.index: c.text for c in whole.choices} and sorted(reasons) == [0, 1, 2, 3]


def golden_prompt_logprobs(i: int) -> tuple[list[int], np.ndarray]:
    """Golden prompt i and transformers' log-probability of each of its tokens after the first."""
    prompt = json.loads((CHECKPOINT / "reference.json").read_text())["prompts"][i]
    logits = np.load(CHECKPOINT / "reference.npz")[f"logits_{i}"][: len(prompt)].astype(np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    return prompt, lp[np.arange(len(prompt) - 1), prompt[1:]]


def test_echo_with_max_tokens_zero_scores_the_prompt(client, engine):
    # lm-eval's loglikelihood request: the context and continuation as one prompt, nothing generated
    prompt, expected = golden_prompt_logprobs(3)  # 130 tokens: scored across two prefill chunks
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 0
    assert choice.finish_reason == "length"
    assert choice.text == engine.tokenizer.decode(prompt, skip_special_tokens=False)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt)
    assert lp.token_logprobs[0] is None
    assert np.abs(np.asarray(lp.token_logprobs[1:]) - expected).max() < 1e-4
    # lm-eval's is_greedy: the continuation token is the top-1 exactly when its logprob is the top one
    assert all(
        max(top.values()) >= got - 1e-6 for top, got in zip(lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True)
    )


def test_echo_with_max_tokens_zero_streams_and_forks(client):
    stream = list(
        client.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=0, echo=True, logprobs=0, n=2, stream=True
        )
    )
    texts, reasons = collect(stream, lambda c: c.text)
    assert texts == {0: "Hello there", 1: "Hello there"} and reasons == {0: "length", 1: "length"}
    without_logprobs = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True)
    assert without_logprobs.choices[0].text == "Hello there" and without_logprobs.choices[0].logprobs is None


def test_max_tokens_zero_without_echo_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.body["message"]
