"""LoRA adapters through the OpenAI API (docs/lora.md): the openai client picks an adapter by its name as `model`,
streaming too; /v1/models lists adapters with their parent; vLLM's load and unload routes; --lora-modules-file
followed while serving; 404 for an unknown adapter and a 400 naming the field for a bad one. Once on an in-thread
engine, once through `capstan serve`'s engine-core process."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import load_file, save_file
from servers import CHECKPOINT, ENGINE_FLAGS, MODEL, START_TIMEOUT, ServeProcess, ThreadServer

sys.path.insert(0, str(Path(__file__).parents[1]))
from lora_adapters import write_adapter  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [11, 12, 13, 14, 15, 16, 17]
SYNC_TIMEOUT = 30  # seconds for a --lora-modules-file change to be served (it is read every 2 s)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {
        "a0": write_adapter(folder / "a0", CHECKPOINT, seed=1, rank=8),
        "a1": write_adapter(folder / "a1", CHECKPOINT, seed=2, rank=4, targets=("q_proj", "v_proj")),
        "a2": write_adapter(folder / "a2", CHECKPOINT, seed=3, rank=8, targets=("gate_proj", "down_proj")),
        "too-big": write_adapter(folder / "too-big", CHECKPOINT, seed=4, rank=32),
    }


def completion(client, model, stream=False):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    if not stream:
        r = client.completions.create(**kwargs)
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs
    chunks = list(client.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs
    ]


def post(url, route, body):
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=120)


def wait_for(check, timeout=SYNC_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise TimeoutError("the change was not served in time")


def model_ids(client):
    return [m.id for m in client.models.list().data]


def check_the_lora_api(url: str, adapters: dict, modules_file: Path) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    cards = {m.id: m.model_dump() for m in client.models.list().data}  # vLLM's extra fields ride along
    assert list(cards) == [MODEL, "a0"]
    assert cards["a0"]["parent"] == MODEL and cards["a0"]["root"] == str(adapters["a0"])
    base, with_a0 = completion(client, MODEL), completion(client, "a0")
    assert with_a0 != base
    assert completion(client, "a0", stream=True)[0] == with_a0[0]
    chat = client.chat.completions.create(model="a0", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "a0" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError) as e:
        completion(client, "a1")
    body = e.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"

    # vLLM's runtime routes: load, serve, refuse a duplicate or a bad one by field, unload
    r = post(url, "load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapters["a1"])})
    assert r.status_code == 200, r.text
    assert "a1" in model_ids(client)
    assert completion(client, "a1") not in (base, with_a0)
    r = post(url, "load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapters["a1"])})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = post(url, "load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["too-big"])})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "r" and "max-lora-rank" in error["message"]
    r = post(url, "load_lora_adapter", {"lora_name": "nowhere", "lora_path": "/no/such/adapter"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert post(url, "unload_lora_adapter", {"lora_name": "a1"}).status_code == 200
    assert "a1" not in model_ids(client)
    with pytest.raises(openai.NotFoundError):
        completion(client, "a1")
    r = post(url, "unload_lora_adapter", {"lora_name": "a1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"

    # the modules file: an added entry is loaded, a bad one logged and left out, a removed one unloaded
    modules_file.write_text(
        json.dumps([{"name": "a2", "path": str(adapters["a2"])}, {"name": "broken", "path": "/none"}])
    )
    wait_for(lambda: "a2" in model_ids(client))
    assert completion(client, "a2") not in (base, with_a0)
    assert "broken" not in model_ids(client)
    modules_file.write_text("[]")
    wait_for(lambda: "a2" not in model_ids(client))
    assert model_ids(client) == [MODEL, "a0"]
    assert completion(client, "a0") == with_a0  # served as before all this
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert re.search(r"^capstan_lora_slots_total 2\.0$", metrics, re.M), metrics
    loads = re.search(r"^capstan_lora_slot_loads_total (\S+)$", metrics, re.M)
    assert loads and float(loads[1]) >= 3  # a0, a1 and a2 through two slots


def test_the_lora_api_on_an_in_thread_engine(adapters, tmp_path):
    from capstan.runtime.config import EngineConfig
    from capstan.runtime.engine.async_llm import AsyncLLM
    from capstan.runtime.server.app import build_app, make_context

    modules_file = tmp_path / "adapters.json"
    modules_file.write_text("[]")
    config = EngineConfig(
        model=str(CHECKPOINT),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules={"a0": str(adapters["a0"])},
        **ENGINE_FLAGS,
    )
    engine = AsyncLLM(config)
    try:
        assert engine.wait_ready(START_TIMEOUT)
        app = build_app(make_context(engine), allow_runtime_lora_updating=True, lora_modules_file=str(modules_file))
        with ThreadServer(app) as s:
            check_the_lora_api(s.url, adapters, modules_file)
        with ThreadServer(build_app(make_context(engine))) as s:  # without the flag: vLLM's 404
            r = post(s.url, "load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapters["a1"])})
            assert r.status_code == 404 and "error" in r.json()
    finally:
        engine.shutdown()


def test_the_lora_api_through_the_engine_core_process(adapters, tmp_path):
    modules_file = tmp_path / "adapters.json"
    modules_file.write_text("[]")
    flags = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a0={adapters['a0']}"]
    with ServeProcess(*flags, "--allow-runtime-lora-updating", "--lora-modules-file", str(modules_file)) as s:
        check_the_lora_api(s.url, adapters, modules_file)
    assert any("broken" in line and "not served" in line for line in s.output), "".join(s.output[-30:])


def test_a_bad_adapter_at_start_is_a_cli_error_naming_the_field(adapters):
    import subprocess

    command = [sys.executable, "-m", "capstan.runtime.cli", "serve", str(CHECKPOINT), "--enable-lora"]
    done = subprocess.run(
        [*command, "--lora-modules", f"big={adapters['too-big']}"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "big=" in done.stderr and "r=32" in done.stderr and "--max-lora-rank" in done.stderr
    nan = write_adapter(adapters["a0"].parent / "nan", CHECKPOINT, seed=5, rank=8)  # issue 68: checked when loaded
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = np.where(np.arange(tensors[first].size).reshape(tensors[first].shape) == 0, np.nan, tensors[first])
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    done = subprocess.run([*command, "--lora-modules", f"nan={nan}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and f"nan={nan}" in done.stderr and "NaN or infinite" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "capstan.runtime.cli", "serve", str(CHECKPOINT), "--lora-modules-file", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--enable-lora" in done.stderr
