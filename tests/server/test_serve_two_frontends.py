"""`capstan serve runtime/default_model --api-server-count 2 --enable-lora` as users run it (issues 68 and 69):
/v1/embeddings answers through either frontend; adapters with NaN weights or corrupt files are refused at start and
at /v1/load_lora_adapter naming the file and the problem; request heads are bounded in size, field count and time
(431, 408) on both frontends; successful probes stay out of the INFO log; and a SIGTERM drain exits 0 even when the
other frontend ends its drain first (last)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from lora_adapters import write_adapter
from request_heads import check_half_sent_heads_are_closed, check_request_heads_are_bounded
from safetensors.numpy import load_file, save_file
from servers import ServeProcess, child_processes

from capstan.runtime.config import DEFAULT_MODEL

pytestmark = pytest.mark.slow
FRONTEND = "capstan.runtime.server.frontend_process"
MODEL = Path(DEFAULT_MODEL)
FLAGS = ("--api-server-count=2", "--enable-lora", "--allow-runtime-lora-updating", "--max-lora-rank=8")


@pytest.fixture(scope="module")
def serve():
    engine_flags = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=128)
    with ServeProcess(*FLAGS, "--drain-timeout=120", model=MODEL, engine_flags=engine_flags) as server:
        yield server


def frontend_pids(server: ServeProcess) -> list[int]:
    children = child_processes(server.process.pid)
    return [server.process.pid, *(pid for pid, command in children.items() if FRONTEND in command)]


def nan_adapter(folder: Path) -> Path:
    write_adapter(folder, MODEL, seed=0, targets=("q_proj", "v_proj"))
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][0, 0] = np.nan
    save_file(tensors, str(weights))
    return folder


def test_embeddings_answer_through_either_frontend(serve):
    for _ in range(6):  # a new connection each: the kernel spreads them over both frontends
        with httpx.Client() as http:
            client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", http_client=http, timeout=60)
            r = client.embeddings.create(model=client.models.list().data[0].id, input=["hello world", "Paris"])
        assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
        for d in r.data:
            assert abs(np.linalg.norm(d.embedding) - 1) < 1e-4


def test_bad_adapters_at_runtime_are_400s_naming_the_file_and_the_problem(serve, tmp_path):
    nan = nan_adapter(tmp_path / "nan")
    short = write_adapter(tmp_path / "short", MODEL, seed=1, targets=("q_proj",))
    (short / "adapter_model.safetensors").write_bytes(b"\x01\x02\x03")
    cases = [
        (nan, "layers.0.q_proj.lora_A holds 1 NaN or infinite value(s)"),
        (short, "3 bytes: not a safetensors file"),
    ]
    for folder, says in cases:
        r = httpx.post(
            f"{serve.url}/v1/load_lora_adapter", json={"lora_name": folder.name, "lora_path": str(folder)}, timeout=60
        )
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert str(folder / "adapter_model.safetensors") in message and says in message, message
    models = httpx.get(f"{serve.url}/v1/models", timeout=10).json()["data"]
    assert not {"nan", "short"} & {m["id"] for m in models}


def test_a_nan_adapter_at_start_ends_the_server_naming_the_file(tmp_path):
    nan = nan_adapter(tmp_path / "nan")
    command = [sys.executable, "-m", "capstan.runtime.cli", "serve", str(MODEL), *FLAGS, "--lora-modules", f"bad={nan}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"--lora-modules bad={nan}: {nan / 'adapter_model.safetensors'}" in done.stderr, done.stderr[-2000:]
    assert "NaN or infinite" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_request_heads_are_bounded_on_both_frontends(serve):
    pids = frontend_pids(serve)
    assert len(pids) == 2, pids
    check_request_heads_are_bounded(serve.port, pids)
    check_half_sent_heads_are_closed(serve.port, f"{serve.url}/health")


def test_successful_probes_are_logged_at_debug_only(serve):
    for path in ("/health", "/ready", "/metrics", "/v1/models", "/health"):
        for _ in range(3):  # a new connection each: both frontends
            assert httpx.get(f"{serve.url}{path}", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while '"GET /v1/models HTTP/1.1" 200' not in "".join(serve.output):
        assert time.monotonic() < deadline, "".join(serve.output)[-3000:]
        time.sleep(0.1)
    log = "".join(serve.output)
    for probe in ("/health", "/ready", "/metrics"):
        assert f'"GET {probe} HTTP/1.1" 200' not in log, log[-3000:]


def accepted_by(sock: socket.socket, port: int, pids: list[int], timeout: float = 10) -> int:
    """Which of pids accepted this client socket (several processes listen on one port): its peer in /proc/net/tcp
    and the process holding that socket's inode."""
    client_port = sock.getsockname()[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inodes = set()
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
            if local == port and remote == client_port and fields[9] != "0":
                inodes.add(f"socket:[{fields[9]}]")
        for pid in pids:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    if os.readlink(fd) in inodes:
                        return pid
                except OSError:
                    continue
        time.sleep(0.05)
    raise AssertionError(f"no process of {pids} accepted the connection from port {client_port}")


def test_sigterm_drain_exits_0_when_the_other_frontend_ends_first(serve):
    """Run last: it ends the server. A long stream in flight on the main process only; on SIGTERM the other frontend
    (idle) ends its drain first, which is no crash: the stream finishes and the server exits 0."""
    pids = frontend_pids(serve)
    for _ in range(50):
        sock = socket.create_connection(("127.0.0.1", serve.port), timeout=120)
        if accepted_by(sock, serve.port, pids) == serve.process.pid:
            break
        sock.close()
    else:
        raise AssertionError("50 connections, none accepted by the main process")
    model = httpx.get(f"{serve.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = json.dumps(
        {"model": model, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "stream": True}
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body
    with sock:
        sock.sendall(request)
        data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200 "), data[:300]
        serve.signal(signal.SIGTERM)
        while chunk := sock.recv(65536):
            data += chunk
    assert b"data: [DONE]" in data[-200:] and b'"finish_reason":"length"' in data, data[-300:]  # chunked: 0 ends it
    code = serve.wait(timeout=60)
    log = "".join(serve.output)
    assert code == 0 and "draining, then exiting" not in log, log[-3000:]
