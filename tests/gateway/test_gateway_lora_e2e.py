"""`capstan gateway` routing LoRA adapters over real `capstan serve --enable-lora` replicas, through the openai client:
a request for an adapter goes only to replicas that list it in /v1/models, an unknown one is a 404 in OpenAI's shape,
and an adapter loaded or unloaded while the replicas run (their --lora-modules-file rewritten, as the kubelet
rewrites a mounted ConfigMap) changes where requests go, with no restart of anything."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from lora_adapters import write_adapter  # noqa: E402
from processes import metric, start_gateway, start_replica  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL  # noqa: E402

pytestmark = pytest.mark.slow
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
RELOAD_TIMEOUT = 60  # seconds: the server polls its file every 2 s, the gateway the replica every 0.25 s


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: str(write_adapter(folder / name, DEFAULT_MODEL, seed=i, rank=4)) for i, name in enumerate(["sql", "chat"])
    }


class ModulesFile:
    """A replica's --lora-modules-file, rewritten whole as the kubelet rewrites a mounted ConfigMap."""

    def __init__(self, path: Path, adapter_paths: dict[str, str]):
        self.path, self.adapter_paths = path, adapter_paths

    def write(self, *names: str) -> ModulesFile:
        staged = self.path.with_suffix(".tmp")
        staged.write_text(json.dumps([{"name": n, "path": self.adapter_paths[n]} for n in names]))
        staged.replace(self.path)
        return self


@pytest.fixture(scope="module")
def lora_replicas(tmp_path_factory, adapter_paths):
    """Replica 0 serves sql; replica 1 serves sql and chat."""
    folder = tmp_path_factory.mktemp("modules")
    files = [ModulesFile(folder / f"replica-{i}.json", adapter_paths) for i in range(2)]
    files[0].write("sql")
    files[1].write("sql", "chat")
    started = [start_replica("tiny", extra=[*LORA_FLAGS, "--lora-modules-file", str(f.path)]) for f in files]
    try:
        yield [r.wait_ready() for r in started], files
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="module")
def gateway(lora_replicas):
    replicas, _ = lora_replicas
    g = start_gateway([f"tiny={r.url}" for r in replicas], "--poll-interval", "0.25")
    try:
        yield g.wait_ready(30)
    finally:
        g.stop()


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)


def routed(gateway, replicas) -> list[float]:
    return [metric(gateway.url, "capstan_gateway_routed_total", replica=r.url) for r in replicas]


def send(client, model: str, n: int, stream: bool = False) -> None:
    for i in range(n):
        prompt = f"request {i} for {model}: " + "a distinct prefix so that keys spread " * (i % 3)
        if stream:
            chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=3, stream=True))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        else:
            assert client.completions.create(model=model, prompt=prompt, max_tokens=3).model == model


def wait_until(what: str, check, timeout: float = RELOAD_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise TimeoutError(f"{what} did not happen within {timeout} s")


def listed(gateway) -> dict[str, dict]:
    return {card["id"]: card for card in httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]}


def test_the_gateway_lists_adapters_with_their_parent(gateway):
    cards = listed(gateway)
    assert {"tiny", "sql", "chat"} <= set(cards)
    assert cards["sql"]["parent"] == cards["chat"]["parent"] == "tiny"
    assert cards["tiny"].get("parent") is None


def test_an_adapter_goes_only_to_replicas_that_have_it(client, gateway, lora_replicas):
    replicas, _ = lora_replicas
    before = routed(gateway, replicas)
    send(client, "chat", 8)
    send(client, "chat", 2, stream=True)
    after = routed(gateway, replicas)
    assert after[0] == before[0] and after[1] - before[1] == 10  # only replica 1 has chat
    before = after
    send(client, "sql", 12)
    after = routed(gateway, replicas)
    assert sum(after) - sum(before) == 12


def test_an_unknown_adapter_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=1)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


def test_adapters_loaded_and_unloaded_at_runtime_move_the_traffic(client, gateway, lora_replicas):
    replicas, files = lora_replicas
    files[0].write("sql", "chat")  # replica 0 gains chat
    wait_until("the gateway seeing chat on replica 0", lambda: "chat" in replica_models(replicas[0]))
    files[1].write("sql")  # replica 1 loses it
    wait_until("replica 1 unloading chat", lambda: "chat" not in replica_models(replicas[1]))
    time.sleep(1.0)  # a few gateway polls (0.25 s)
    before = routed(gateway, replicas)
    send(client, "chat", 6)
    after = routed(gateway, replicas)
    assert after[0] - before[0] == 6 and after[1] == before[1]

    files[0].write("sql")  # chat gone everywhere: a 404, at once
    wait_until("replica 0 unloading chat", lambda: "chat" not in replica_models(replicas[0]))
    time.sleep(1.0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt="hi", max_tokens=1)
    files[0].write("sql", "chat")  # restore the fixture's shape for any later test
    files[1].write("sql", "chat")
    wait_until("chat back on both", lambda: all("chat" in replica_models(r) for r in replicas))


def replica_models(replica) -> set[str]:
    return {card["id"] for card in httpx.get(f"{replica.url}/v1/models", timeout=10).json()["data"]}
