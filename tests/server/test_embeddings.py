"""/v1/embeddings through the openai client against the real server, checked against transformers: the golden
logits are the final hidden states times lm_head, so least squares through lm_head recovers those states (exactly:
lm_head has full column rank), and pooling them is the reference embedding."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import load_file
from servers import CHECKPOINT, MODEL

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def transformers_hidden_states(i: int) -> tuple[list[int], np.ndarray]:
    """Golden prompt i and transformers' final (normed) hidden states of its tokens, [tokens, hidden]."""
    weights = load_file(str(CHECKPOINT / "model.safetensors"))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).astype(np.float64)
    prompt = json.loads((CHECKPOINT / "reference.json").read_text())["prompts"][i]
    logits = np.load(CHECKPOINT / "reference.npz")[f"logits_{i}"][: len(prompt)].astype(np.float64)
    hidden, *_ = np.linalg.lstsq(head, logits.T, rcond=None)
    return prompt, hidden.T


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_last_token_pooling_matches_transformers(client):
    # prompt 3 has 130 tokens: more than the server's 128-token step, so it is embedded in two chunks
    cases = [transformers_hidden_states(i) for i in (1, 2, 3)]
    r = client.embeddings.create(model=MODEL, input=[p for p, _ in cases], encoding_format="float")
    assert r.object == "list" and r.model == MODEL and [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(p) for p, _ in cases)
    for d, (_, hidden) in zip(r.data, cases, strict=True):
        got = np.asarray(d.embedding)
        assert got.shape == (hidden.shape[1],) and abs(np.linalg.norm(got) - 1) < 1e-5
        assert np.abs(got - unit(hidden[-1])).max() < 1e-4


def test_mean_pooling_matches_transformers():
    from capstan import LLM

    llm = LLM(
        str(CHECKPOINT),
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        warmup=False,
        embedding_pooling="mean",
    )
    prompts, hidden = zip(*(transformers_hidden_states(i) for i in (2, 3)), strict=True)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for out, h in zip(outs, hidden, strict=True):
        assert np.abs(np.asarray(out.outputs.embedding) - unit(h.mean(axis=0))).max() < 1e-4
    llm.engine.pool.check_all_free()


def test_base64_decodes_to_the_floats(client, server):
    floats = client.embeddings.create(model=MODEL, input="The sea is calm", encoding_format="float").data[0].embedding
    raw = httpx.post(
        f"{server}/v1/embeddings", json={"input": "The sea is calm", "encoding_format": "base64"}, timeout=60
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == floats
    # the SDK asks for base64 by default and decodes it itself
    assert client.embeddings.create(model=MODEL, input="The sea is calm").data[0].embedding == floats


def test_input_forms_agree(client, engine):
    text = "hello embeddings"
    ids = engine.tokenizer.encode(text)
    by_text = client.embeddings.create(model=MODEL, input=text).data[0].embedding
    by_ids = client.embeddings.create(model=MODEL, input=ids).data[0].embedding
    batch = client.embeddings.create(model=MODEL, input=[ids, ids[:2]]).data
    assert np.allclose(by_text, by_ids, atol=1e-6) and np.allclose(batch[0].embedding, by_ids, atol=1e-6)
    assert not np.allclose(batch[1].embedding, by_ids, atol=1e-3)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], [10**6]]}, "input[1]"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": [1] * 600}, "input"),  # longer than the served context (512)
    ],
)
def test_bad_embedding_requests_name_the_field(server, body, param):
    r = httpx.post(f"{server}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_dimensions_equal_to_the_model_is_accepted(client):
    size = len(client.embeddings.create(model=MODEL, input="x").data[0].embedding)
    assert len(client.embeddings.create(model=MODEL, input="x", dimensions=size).data[0].embedding) == size


def test_embeddings_and_generation_share_the_engine(client):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        gens = [
            pool.submit(client.completions.create, model=MODEL, prompt="Once upon", max_tokens=20, temperature=0)
            for _ in range(2)
        ]
        embs = [pool.submit(client.embeddings.create, model=MODEL, input=["a b c"] * 5) for _ in range(2)]
        assert all(g.result().usage.completion_tokens == 20 for g in gens)
        assert all(len(e.result().data) == 5 for e in embs)
