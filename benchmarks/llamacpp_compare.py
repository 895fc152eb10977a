"""Capstan against llama.cpp on CPU, on the same GGUF, both through the OpenAI API on 127.0.0.1, in one run:

    python benchmarks/llamacpp_compare.py --llamacpp-python /work/venv-gguf/bin/python [--gguf MODEL.gguf]

Starts `capstan serve` and then `python -m llama_cpp.server` (one at a time, so they do not share the cores),
and measures each: single-stream output tokens/s (requests one after another) and throughput with 16 concurrent
streams. Every request asks for --max-tokens tokens with EOS banned through logit_bias (both servers honour it),
so both make the same number of tokens. Output tokens/s counts each request's whole time, prefill included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve import WORDS  # noqa: E402  (the load generator's prompt words)

EOS_BANNED = {"2": -100}  # SmolLM2's <|im_end|> / EOS id: every request runs to max_tokens
START_TIMEOUT = 900  # seconds: Capstan's warm-up compiles on a busy 2-core machine


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def complete(http: httpx.AsyncClient, model: str, text: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "logit_bias": EOS_BANNED}
    r = (await http.post("/v1/completions", json=body)).raise_for_status().json()
    return r["usage"]["completion_tokens"]


async def measure(url: str, model: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1200)) as http:
        await complete(http, model, prompt(rng, 8), 4)  # first request: lazy set-up outside the figures
        start, tokens = time.perf_counter(), 0
        for _ in range(args.single_requests):
            tokens += await complete(http, model, prompt(rng, args.prompt_words), args.max_tokens)
        single = tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(complete(http, model, prompt(rng, args.prompt_words), args.max_tokens) for _ in range(args.streams))
        )
        concurrent = sum(counts) / (time.perf_counter() - start)
    assert all(c == args.max_tokens for c in counts), counts
    return {"single_stream_tok_s": single, f"{args.streams}_streams_tok_s": concurrent}


def wait_until(url: str, path: str, process: subprocess.Popen, command: list[str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[:4]!r} exited with {process.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}{path} not ready in {START_TIMEOUT} s")


def run_server(
    command: list[str], port: int, ready_path: str, model: str, args: argparse.Namespace, env: dict | None = None
) -> dict:
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        command,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    try:
        wait_until(url, ready_path, process, command)
        return asyncio.run(measure(url, model, args))
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def main() -> None:
    from capstan.runtime.config import installed_smollm2

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="the model (default: the installed SmolLM2-135M-Instruct)")
    parser.add_argument("--llamacpp-python", required=True, help="an interpreter with llama-cpp-python[server]")
    parser.add_argument("--llamacpp-pythonpath", default="", help="extra PYTHONPATH for that interpreter")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--single-requests", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (XLA uses all)")
    args = parser.parse_args()
    gguf = args.gguf or str(installed_smollm2())
    model = "bench"
    capstan = [
        sys.executable,
        "-m",
        "capstan.runtime.cli",
        "serve",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port := free_port()),
        "--served-model-name",
        model,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        "256",
    ]
    results = {"capstan": run_server(capstan, port, "/ready", model, args)}
    print("capstan  ", results["capstan"], flush=True)
    llamacpp = [
        args.llamacpp_python,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port := free_port()),
        "--model_alias",
        model,
        "--n_ctx",
        str(args.max_model_len),
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
    ]
    env = {"PYTHONPATH": args.llamacpp_pythonpath} if args.llamacpp_pythonpath else None
    results["llama.cpp"] = run_server(llamacpp, port, "/v1/models", model, args, env)
    print("llama.cpp", results["llama.cpp"], flush=True)
    for key in results["capstan"]:
        print(f"{key}: capstan / llama.cpp = {results['capstan'][key] / results['llama.cpp'][key]:.2f}")


if __name__ == "__main__":
    main()
