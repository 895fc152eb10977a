"""A new user's first run: `capstan serve` with no model and no flags serves SmolLM2-135M-Instruct with its card's
sampling (temperature 0.2, top_p 0.9), and at temperature 0 the capital of France is Paris. Through the openai
client, as the README's snippet does. Questions at the API's defaults: benchmarks/default_model_questions.py."""

from __future__ import annotations

import pytest
from openai import OpenAI

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test waits for the default model's warm-up
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served(default_model_server):
    return default_model_server  # `capstan serve`, as the README's quick start (tests/server/conftest.py)


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", timeout=120, max_retries=0)


def ask(client, question: str, **fields):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], **fields)


def test_the_capital_of_france_is_paris(client):
    assert "Paris" in ask(client, "What is the capital of France?", temperature=0).choices[0].message.content


def test_the_responses_api_answers_as_the_readmes_snippet_asks(client):
    answer = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0)
    assert answer.status == "completed" and "Paris" in answer.output_text


def test_the_start_log_names_the_models_sampling(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    log = "".join(served.output)
    assert "temperature=0.2, top_p=0.9" in log and "--generation-config vllm" in log, log[-3000:]
