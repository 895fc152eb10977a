"""Capstan against llama.cpp on CPU, on the same GGUF, both through the OpenAI API on 127.0.0.1, in one run:

    python benchmarks/llamacpp_compare.py                     # builds llama.cpp's server once (cached), then measures
    python benchmarks/llamacpp_compare.py --streams 1 4 16 --rounds 3

llama.cpp: its own server (`llama-server`), built once from the llama.cpp that llama-cpp-python's source package
vendors (LLAMACPP_PYTHON_VERSION, from PyPI: `pip download`, then CMake and a C++ compiler), cached under
~/.cache/capstan/llamacpp (not in CI); --llama-server PATH takes a binary built elsewhere, and --llamacpp-python
PYTHON runs llama-cpp-python's own server instead (`python -m llama_cpp.server`, one request at a time). It runs
with --threads threads (default: every core) and as many slots as the largest stream count (continuous batching),
each slot --max-model-len tokens of context.

Capstan: `capstan serve` with its defaults for this machine, but --max-num-seqs as the largest stream count,
--max-model-len and a 256-token step budget; its compilation cache (~/.cache/capstan/xla) makes later starts fast.

The servers run one after the other (never sharing the cores), each measured at every --streams count: a round
sends that many requests at once and counts output tokens over the round's whole time (prefill included); the
median of --rounds rounds is reported, with the server processes' CPU seconds per output token (all threads; the
steadier figure when other work shares the machine) and the load average (/proc/loadavg) before and after. Every
request asks for --max-tokens tokens at temperature 0 with EOS banned through logit_bias, so both servers make the
same number of tokens; other sampling fields are each server's defaults (Capstan applies the model's generation
config, SmolLM2's repetition_penalty 1.1; llama-server's repeat penalty is off by default).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve import WORDS  # noqa: E402  (the load generator's prompt words)

EOS_BANNED = {"2": -100}  # SmolLM2's <|im_end|> / EOS id: every request runs to max_tokens
START_TIMEOUT = 1200  # seconds: Capstan's first warm-up compiles on a busy 2-core machine
LLAMACPP_PYTHON_VERSION = "0.3.36"  # the llama-cpp-python source package whose vendored llama.cpp we build
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "capstan" / "llamacpp"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def llama_server(version: str = LLAMACPP_PYTHON_VERSION) -> Path:
    """llama.cpp's server binary, built on first use from llama-cpp-python's source package (its vendored
    llama.cpp) into CACHE/<version>/ and found there afterwards."""
    root = CACHE / version
    binary = root / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    if shutil.which("cmake") is None:
        raise SystemExit("building llama.cpp needs cmake (pip install cmake) and a C++ compiler (apt-get install g++)")
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        log(f"downloading llama-cpp-python {version}'s source package from PyPI")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(root),
             f"llama-cpp-python=={version}"],
            check=True,
        )  # fmt: skip
    source = root / "src"
    if not (source / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")
    log(f"building llama-server in {root / 'build'} (several minutes on 2 cores)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(root / "build"), *generator, "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
         "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"],
        check=True,
    )  # fmt: skip
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(root / "build"), "--target", "llama-server", "-j", jobs], check=True)
    return binary


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


def group_cpu_seconds(pgid: int) -> float:
    """User and system CPU seconds of every live process in the process group (the server and its children)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ..., utime (11), stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / ticks


async def measure(url: str, model: str, pgid: int, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    rng = random.Random(0)
    results = {}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800)) as http:
        await complete(http, model, prompt(rng, 8), 4)  # first request: lazy set-up outside the figures
        for streams in args.streams:
            rounds = []
            for _ in range(args.rounds):
                texts = [prompt(rng, args.prompt_words) for _ in range(streams)]
                start, cpu = time.perf_counter(), group_cpu_seconds(pgid)
                counts = await asyncio.gather(*(complete(http, model, t, args.max_tokens) for t in texts))
                wall, cpu = time.perf_counter() - start, group_cpu_seconds(pgid) - cpu
                assert all(c == args.max_tokens for c in counts), counts
                rounds.append((sum(counts) / wall, 1000 * cpu / sum(counts)))
            tok_s = statistics.median(r[0] for r in rounds)
            results[streams] = {"tok_s": tok_s, "cpu_ms": statistics.median(r[1] for r in rounds)}
            log(f"  {streams:3d} streams: {tok_s:7.1f} tokens/s (rounds: {', '.join(f'{r[0]:.1f}' for r in rounds)})")
    return results


def wait_until(url: str, path: str, process: subprocess.Popen, name: str, args) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}: see {args.log_dir / (name + '.log')}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}{path} not ready in {START_TIMEOUT} s")


def run_server(name: str, command: list[str], port: int, ready_path: str, args, env: dict | None = None) -> dict:
    url = f"http://127.0.0.1:{port}"
    logfile = open(args.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed below, after the process
    started = time.monotonic()
    process = subprocess.Popen(
        command, start_new_session=True, stdout=logfile, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    try:
        wait_until(url, ready_path, process, name, args)
        log(f"{name}: ready in {time.monotonic() - started:.0f} s; load average {load_average()}")
        before = load_average()
        results = asyncio.run(measure(url, "bench", process.pid, args))
        return {"streams": results, "load": (before, load_average())}
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        logfile.close()


def main() -> None:
    from capstan.runtime.config import installed_smollm2

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="the model (default: the installed SmolLM2-135M-Instruct)")
    parser.add_argument("--llama-server", default=None, help="a llama-server binary (default: built once, cached)")
    parser.add_argument("--llamacpp-python", default=None, help="run llama-cpp-python's server with this interpreter")
    parser.add_argument("--llamacpp-pythonpath", default="", help="extra PYTHONPATH for that interpreter")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per stream count (the median is reported)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (XLA uses all)")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="where the servers' logs go")
    parser.add_argument("--capstan-arg", action="append", default=[], help="an extra `capstan serve` argument")
    args = parser.parse_args()
    gguf = args.gguf or str(installed_smollm2())
    slots = max(args.streams)
    started = time.monotonic()
    if args.llamacpp_python:
        llamacpp = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "bench",
                    "--n_ctx", str(args.max_model_len), "--n_threads", str(args.threads),
                    "--n_threads_batch", str(args.threads)]  # fmt: skip
        ready, llamacpp_name = "/v1/models", "llama-cpp-python"
    else:
        binary = Path(args.llama_server) if args.llama_server else llama_server()
        llamacpp = [str(binary), "--model", gguf, "--alias", "bench", "--threads", str(args.threads),
                    "--threads-batch", str(args.threads), "--parallel", str(slots),
                    "--ctx-size", str(args.max_model_len * slots), "--no-webui"]  # fmt: skip
        ready, llamacpp_name = "/health", "llama-server"
    print(f"load average at start: {load_average()}", flush=True)
    capstan = [sys.executable, "-m", "capstan.runtime.cli", "serve", gguf, "--served-model-name", "bench",
               "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(slots),
               "--max-num-batched-tokens", "256", *args.capstan_arg]  # fmt: skip
    results = {}
    port = free_port()
    results["capstan"] = run_server(
        "capstan", [*capstan, "--host", "127.0.0.1", "--port", str(port)], port, "/ready", args
    )
    port = free_port()
    env = {"PYTHONPATH": args.llamacpp_pythonpath} if args.llamacpp_pythonpath else None
    command = [*llamacpp, "--host", "127.0.0.1", "--port", str(port)]
    results[llamacpp_name] = run_server(llamacpp_name, command, port, ready, args, env)
    ours, theirs = results["capstan"], results[llamacpp_name]
    print(
        f"\n{gguf}, {args.max_tokens} tokens out, prompts of {args.prompt_words} words, median of {args.rounds} rounds"
    )
    print(
        f"| streams | Capstan tokens/s | {llamacpp_name} tokens/s | Capstan / {llamacpp_name} | CPU ms/token (Capstan / {llamacpp_name}) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for streams in args.streams:
        a, b = ours["streams"][streams], theirs["streams"][streams]
        print(
            f"| {streams} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | {a['tok_s'] / b['tok_s']:.2f} | "
            f"{a['cpu_ms']:.1f} / {b['cpu_ms']:.1f} |"
        )
    print(f"load average (1, 5, 15 min) during Capstan: {ours['load'][0]} -> {ours['load'][1]}; "
          f"during {llamacpp_name}: {theirs['load'][0]} -> {theirs['load'][1]}")  # fmt: skip
    print(f"took {time.monotonic() - started:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
