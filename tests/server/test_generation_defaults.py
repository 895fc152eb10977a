"""The model's sampling defaults through the real `capstan serve` and the openai client: a checkpoint whose
generation_config.json sets top_k 1 answers requests without sampling fields exactly as temperature 0 does;
--override-generation-config beats the file; a request's own field beats both; the start log says which apply."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from servers import CHECKPOINT, ServeProcess

pytestmark = pytest.mark.slow
NAME = "gen-defaults"
PROMPTS = ["Once upon a time", "The sea"]
MODEL_FILE = {"top_k": 1, "max_new_tokens": 5, "eos_token_id": 511}  # greedy, 5 tokens
OVERRIDE = {"max_new_tokens": 7}  # beats the file's 5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("top_k_1")
    for f in CHECKPOINT.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    (folder / "generation_config.json").write_text(json.dumps(MODEL_FILE))
    with ServeProcess(
        "--served-model-name", NAME, f"--override-generation-config={json.dumps(OVERRIDE)}", model=folder
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", timeout=60, max_retries=0)


def completion(client, prompt: str, extra: dict | None = None, **fields):
    # ignore_eos: the random checkpoint may end early; it is no sampling default, so it changes nothing here
    body = {"ignore_eos": True, **(extra or {})}
    return client.completions.create(model=NAME, prompt=prompt, extra_body=body, **fields).choices[0]


def test_no_sampling_fields_give_the_models_greedy_tokens_for_the_overrides_length(client):
    for prompt in PROMPTS:
        default = completion(client, prompt)
        greedy = completion(client, prompt, temperature=0, max_tokens=7)
        assert default.text == greedy.text and default.finish_reason == "length"
        assert (
            client.completions.create(
                model=NAME, prompt=prompt, max_tokens=50, temperature=0, extra_body={"ignore_eos": True}
            ).usage.completion_tokens
            == 50
        )


def test_a_request_field_beats_the_override_and_the_model(client):
    prompt = PROMPTS[0]
    short = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 3
    greedy = completion(client, prompt, temperature=0, max_tokens=7)
    # the request's temperature, the model's top_k 1: still greedy
    assert completion(client, prompt, seed=5, temperature=2.0).text == greedy.text
    # the request's top_k 0 (off) beats the model's 1: sampled
    assert completion(client, prompt, {"top_k": 0}, seed=5, temperature=2.0).text != greedy.text


def test_chat_without_max_tokens_takes_the_default_length(client):
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hello"}], extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_the_start_log_says_which_defaults_apply(served):
    log = "".join(served.output)
    assert (
        "default sampling parameters from the model's generation config (auto) and "
        "--override-generation-config: max_tokens=7, top_k=1"
    ) in log, log[-3000:]
