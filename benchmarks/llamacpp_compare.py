"""Capstan against llama.cpp on CPU, on the same GGUF, all through the OpenAI API on 127.0.0.1, in one run:

    python benchmarks/llamacpp_compare.py                     # Capstan and llama-server (built once, cached)
    python benchmarks/llamacpp_compare.py --streams 1 4 16 --rounds 3
    python benchmarks/llamacpp_compare.py --servers capstan llama-server llama-cpp-python --streams 1 4 16 --rounds 3
    python benchmarks/llamacpp_compare.py --interleave --streams 1 16 --rounds 8   # paired rounds, both servers up

Servers (--servers, measured in the order given):
- capstan: `capstan serve` with its defaults for this machine, but --max-num-seqs as the largest stream count,
  --max-model-len and a 256-token step budget; its compilation cache (~/.cache/capstan/xla) makes later starts fast.
- llama-server: llama.cpp's own server, with --threads threads (default: every core) and as many slots as the
  largest stream count (continuous batching), each slot --max-model-len tokens of context. --llama-server PATH takes
  a binary built elsewhere; by default it is built once into CACHE/<version>/build, statically linked.
- llama-cpp-python: `python -m llama_cpp.server --n_ctx <max-model-len> --n_threads/--n_threads_batch <threads>`,
  which serves one request at a time (a lock around its one context; the others wait). --llamacpp-python PYTHON takes
  an interpreter where llama-cpp-python is installed; by default it is set up once under CACHE/<version>: libllama and
  ggml built shared (`cmake --build build-shared --target llama`), then `python3.11 -m venv venv` and
  `CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" venv/bin/pip install "llama_cpp_python[server] @ file://<sdist>"`
  (the package's Python code with no compiled library; the server's dependencies from PyPI), run with
  LLAMA_CPP_LIB_PATH=build-shared/bin so it loads that libllama.

Both llama.cpp builds come from the llama.cpp that llama-cpp-python's source package (LLAMACPP_PYTHON_VERSION,
`pip download`ed from PyPI once) vendors, configured with the same CMAKE_FLAGS (Release, -DGGML_NATIVE=ON, no curl,
tests or examples; CMake and a C++ compiler needed), cached under CACHE = ~/.cache/capstan/llamacpp (not in CI).

The servers run one after the other (never sharing the cores; with --interleave all are up at once, idle but for the
one measured, and the rounds alternate between them, each round's prompts the same for all: a paired comparison
that a shared host's drifting speed does not bias), each measured at every --streams count: a round
sends that many requests at once and counts output tokens over the round's whole time (prefill included); the
median of --rounds rounds is reported, with the server processes' CPU seconds per output token (all threads; the
steadier figure when other work shares the machine) and the load average (/proc/loadavg) before and after. Every
request asks for --max-tokens tokens at temperature 0 with EOS banned through logit_bias, so every server makes the
same number of tokens (each request's usage.completion_tokens is checked against --max-tokens; llama-cpp-python
applies logit_bias with a logits processor in Python); other sampling fields are each server's defaults (Capstan
applies the model's generation config, SmolLM2's repetition_penalty 1.1; llama-server's repeat penalty is off by
default; llama-cpp-python's server defaults repeat_penalty to 1.1).
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
from first_answer import programs_compiling  # noqa: E402
from serve import WORDS  # noqa: E402  (the load generator's prompt words)

EOS_BANNED = {"2": -100}  # SmolLM2's <|im_end|> / EOS id: every request runs to max_tokens
START_TIMEOUT = 1200  # seconds: Capstan's first warm-up compiles on a busy 2-core machine
LLAMACPP_PYTHON_VERSION = "0.3.36"  # the llama-cpp-python source package whose vendored llama.cpp we build
SERVERS = ("capstan", "llama-server", "llama-cpp-python")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "capstan" / "llamacpp"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# One set of CMake flags for both builds, so llama-server and llama-cpp-python run the same llama.cpp code paths.
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"]  # fmt: skip


def llamacpp_source(version: str) -> Path:
    """CACHE/<version>/src: the llama.cpp vendored in llama-cpp-python's source package (downloaded from PyPI once)."""
    if shutil.which("cmake") is None:
        raise SystemExit("building llama.cpp needs cmake (pip install cmake) and a C++ compiler (apt-get install g++)")
    root = CACHE / version
    root.mkdir(parents=True, exist_ok=True)
    sdist = llamacpp_python_sdist(version)
    source = root / "src"
    if not (source / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")
    return source


def llamacpp_python_sdist(version: str) -> Path:
    root = CACHE / version
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        log(f"downloading llama-cpp-python {version}'s source package from PyPI")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(root),
             f"llama-cpp-python=={version}"],
            check=True,
        )  # fmt: skip
    return sdist


def cmake_build(source: Path, build: Path, target: str, shared: bool) -> None:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    linking = f"-DBUILD_SHARED_LIBS={'ON' if shared else 'OFF'}"
    server = f"-DLLAMA_BUILD_SERVER={'OFF' if shared else 'ON'}"
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_FLAGS, server, linking], check=True
    )
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(build), "--target", target, "-j", jobs], check=True)


def llama_server(version: str = LLAMACPP_PYTHON_VERSION) -> Path:
    """llama.cpp's server binary, built on first use from llama-cpp-python's source package (its vendored
    llama.cpp) into CACHE/<version>/build (statically linked) and found there afterwards."""
    binary = CACHE / version / "build" / "bin" / "llama-server"
    if not binary.is_file():
        source = llamacpp_source(version)
        log(f"building llama-server in {binary.parent.parent} (several minutes on 2 cores)")
        cmake_build(source, binary.parent.parent, "llama-server", shared=False)
    return binary


def llamacpp_python(version: str = LLAMACPP_PYTHON_VERSION) -> tuple[Path, dict[str, str]]:
    """An interpreter with llama-cpp-python <version> and its server's dependencies, and the environment it needs,
    set up on first use under CACHE/<version> and found there afterwards:
    libllama and ggml built shared (CMAKE_FLAGS, target llama) into build-shared/bin, a venv (python3.11 -m venv)
    with the package from the same source package installed with LLAMA_BUILD=OFF (its Python code only; it finds
    the compiled libraries through LLAMA_CPP_LIB_PATH=build-shared/bin) and the [server] extra from PyPI."""
    root = CACHE / version
    libraries = root / "build-shared" / "bin"
    python = root / "venv" / "bin" / "python"
    installed = root / "venv" / "llama-cpp-python-installed"  # written last: a cut-off set-up is redone
    if not (libraries / "libllama.so").is_file():
        source = llamacpp_source(version)
        log(f"building libllama (shared) in {libraries.parent} (minutes on 2 cores)")
        cmake_build(source, libraries.parent, "llama", shared=True)
    if not installed.is_file():
        interpreter = shutil.which("python3.11") or sys.executable
        # cwd: `python -m` puts the working directory first on sys.path, and this repository's operator/ would
        # shadow the standard library's operator module
        subprocess.run([interpreter, "-m", "venv", str(root / "venv")], check=True, cwd=root)
        log(f"installing llama-cpp-python {version} (Python code only) and its server's dependencies")
        env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}
        requirement = f"llama_cpp_python[server] @ {llamacpp_python_sdist(version).as_uri()}"
        subprocess.run(
            [str(python), "-m", "pip", "install", "--no-cache-dir", requirement], check=True, env=env, cwd=root
        )
        installed.write_text(version + "\n")
    return python, {"LLAMA_CPP_LIB_PATH": str(libraries)}


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


async def one_round(http: httpx.AsyncClient, model: str, pgid: int, texts: list[str], args) -> tuple[float, float]:
    """The texts sent at once: (output tokens/s over the round's wall time, the server's CPU ms per output token)."""
    start, cpu = time.perf_counter(), group_cpu_seconds(pgid)
    counts = await asyncio.gather(*(complete(http, model, t, args.max_tokens) for t in texts))
    wall, cpu = time.perf_counter() - start, group_cpu_seconds(pgid) - cpu
    assert all(c == args.max_tokens for c in counts), counts
    return sum(counts) / wall, 1000 * cpu / sum(counts)


async def measure(url: str, model: str, pgid: int, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    rng = random.Random(0)
    results = {}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800)) as http:
        await complete(http, model, prompt(rng, 8), 4)  # first request: lazy set-up outside the figures
        for streams in args.streams:
            rounds = []
            for _ in range(args.rounds):
                texts = [prompt(rng, args.prompt_words) for _ in range(streams)]
                rounds.append(await one_round(http, model, pgid, texts, args))
            tok_s = statistics.median(r[0] for r in rounds)
            results[streams] = {"tok_s": tok_s, "cpu_ms": statistics.median(r[1] for r in rounds)}
            log(f"  {streams:3d} streams: {tok_s:7.1f} tokens/s (rounds: {', '.join(f'{r[0]:.1f}' for r in rounds)})")
    return results


async def measure_interleaved(servers: dict[str, tuple[str, int]], args: argparse.Namespace) -> dict[str, dict]:
    """--interleave: every server up at once (idle while another is measured), each round's same prompts sent to one
    server after the other, rounds alternating: a drift of the machine's speed (a shared host's neighbours) falls on
    all of them alike. Adds each server's per-round ratio to Capstan's ("paired", median over rounds)."""
    rng = random.Random(0)
    results: dict[str, dict] = {name: {"streams": {}} for name in servers}
    clients = {name: httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800)) for name, (url, _) in servers.items()}
    try:
        for http in clients.values():
            await complete(http, "bench", prompt(rng, 8), 4)  # first request: lazy set-up outside the figures
        for streams in args.streams:
            rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
            for i in range(args.rounds):
                texts = [prompt(rng, args.prompt_words) for _ in range(streams)]
                order = list(servers) if i % 2 == 0 else list(reversed(servers))  # neither always goes first
                for name in order:
                    rounds[name].append(await one_round(clients[name], "bench", servers[name][1], texts, args))
            for name, got in rounds.items():
                tok_s = statistics.median(r[0] for r in got)
                entry = {"tok_s": tok_s, "cpu_ms": statistics.median(r[1] for r in got)}
                if "capstan" in rounds and name != "capstan":
                    entry["paired"] = statistics.median(
                        c[0] / r[0] for c, r in zip(rounds["capstan"], got, strict=True)
                    )
                results[name]["streams"][streams] = entry
                paired = f", Capstan / {name} by round: {entry['paired']:.2f}" if "paired" in entry else ""
                log(f"{name} {streams:3d} streams: {tok_s:7.1f} tokens/s (rounds: "
                    f"{', '.join(f'{r[0]:.1f}' for r in got)}){paired}")  # fmt: skip
    finally:
        for http in clients.values():
            await http.aclose()
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


def wait_compiled(url: str, process: subprocess.Popen, name: str, args) -> None:
    """Until Capstan's background warm-up has compiled every program (capstan_programs_compiling 0): serve answers
    before that, and rounds that share the cores with XLA's compiles measure the compiles."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}: see {args.log_dir / (name + '.log')}")
        if programs_compiling(url) == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{url} still compiling after {START_TIMEOUT} s")


def start_server(
    name: str, command: list[str], port: int, ready_path: str, args, env: dict | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """The server started and ready (Capstan: every program compiled); stop_server ends it."""
    url = f"http://127.0.0.1:{port}"
    logfile = open(args.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed by stop_server, after the process
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        start_new_session=True,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    process.logfile = logfile  # type: ignore[attr-defined]
    try:
        wait_until(url, ready_path, process, name, args)
        if name == "capstan":
            wait_compiled(url, process, name, args)
    except BaseException:
        stop_server(process)
        raise
    took = time.monotonic() - started  # Capstan's: until every program is compiled
    log(f"{name}: ready in {took:.0f} s; load average {load_average()}")
    return process


def stop_server(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)
    process.logfile.close()  # type: ignore[attr-defined]


def run_server(
    name: str, command: list[str], port: int, ready_path: str, args, env: dict | None = None, cwd: Path | None = None
) -> dict:
    process = start_server(name, command, port, ready_path, args, env, cwd)
    try:
        before = load_average()
        results = asyncio.run(measure(f"http://127.0.0.1:{port}", "bench", process.pid, args))
        return {"streams": results, "load": (before, load_average())}
    finally:
        stop_server(process)


# A server's command line (less host and port), readiness path, extra environment and working directory.
ServerCommand = tuple[list[str], str, dict[str, str], Path | None]


def server_commands(args: argparse.Namespace, gguf: str) -> dict[str, ServerCommand]:
    """Each chosen server's ServerCommand; any llama.cpp build happens here, before anything is measured."""
    slots = max(args.streams)
    commands: dict[str, ServerCommand] = {}
    for name in args.servers:
        if name == "capstan":
            command = [sys.executable, "-m", "capstan.runtime.cli", "serve", gguf, "--served-model-name", "bench",
                       "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(slots),
                       "--max-num-batched-tokens", "256", *args.capstan_arg]  # fmt: skip
            commands[name] = (command, "/ready", {}, None)
        elif name == "llama-server":
            binary = Path(args.llama_server) if args.llama_server else llama_server()
            command = [str(binary), "--model", gguf, "--alias", "bench", "--threads", str(args.threads),
                       "--threads-batch", str(args.threads), "--parallel", str(slots),
                       "--ctx-size", str(args.max_model_len * slots), "--no-webui"]  # fmt: skip
            commands[name] = (command, "/health", {}, None)
        else:
            given = args.llamacpp_python  # a path, made absolute for the other working directory, or a name on PATH
            python = (Path(given).absolute() if os.sep in given else Path(given)) if given else None
            python, env = (python, {}) if python else llamacpp_python()
            if args.llamacpp_pythonpath:
                env["PYTHONPATH"] = os.pathsep.join(map(os.path.abspath, args.llamacpp_pythonpath.split(os.pathsep)))
            CACHE.mkdir(parents=True, exist_ok=True)
            command = [str(python), "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "bench",
                       "--n_ctx", str(args.max_model_len), "--n_threads", str(args.threads),
                       "--n_threads_batch", str(args.threads)]  # fmt: skip
            commands[name] = (command, "/v1/models", env, CACHE)  # not this repository: see llamacpp_python()
    return commands


def ratio(ours: float, theirs: dict) -> str:
    """Capstan's tokens/s over theirs (medians), and with --interleave the median of the rounds' own ratios."""
    text = f"{ours / theirs['tok_s']:.2f}"
    return text + (f" (by round {theirs['paired']:.2f})" if "paired" in theirs else "")


def print_table(results: dict[str, dict], gguf: str, args: argparse.Namespace) -> None:
    names = list(results)
    ratios = [n for n in names if n != "capstan"] if "capstan" in results else []
    print(
        f"\n{gguf}, {args.max_tokens} tokens out, prompts of {args.prompt_words} words, median of {args.rounds} rounds"
    )
    label = {"capstan": "Capstan"}
    header = ["streams", *(f"{label.get(n, n)} tokens/s" for n in names), *(f"Capstan / {n}" for n in ratios)]
    header.append(f"CPU ms/token ({' / '.join(label.get(n, n) for n in names)})")
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---:" for _ in header) + " |")
    for streams in args.streams:
        row = [str(streams), *(f"{results[n]['streams'][streams]['tok_s']:.1f}" for n in names)]
        ours = results["capstan"]["streams"][streams]["tok_s"] if ratios else 0.0
        row += [ratio(ours, results[n]["streams"][streams]) for n in ratios]
        row.append(" / ".join(f"{results[n]['streams'][streams]['cpu_ms']:.1f}" for n in names))
        print("| " + " | ".join(row) + " |")
    during = "; ".join(f"during {n}: {results[n]['load'][0]} -> {results[n]['load'][1]}" for n in names)
    print(f"load average (1, 5, 15 min) {during}")


def main() -> None:
    from capstan.runtime.config import installed_smollm2

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="the model (default: the installed SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--servers",
        nargs="+",
        choices=SERVERS,
        default=None,
        help="which servers to measure, in this order (default: capstan llama-server; capstan llama-cpp-python "
        "with --llamacpp-python)",
    )
    parser.add_argument("--llama-server", default=None, help="a llama-server binary (default: built once, cached)")
    parser.add_argument(
        "--llamacpp-python", default=None, help="an interpreter with llama-cpp-python (default: a venv set up once)"
    )
    parser.add_argument("--llamacpp-pythonpath", default="", help="extra PYTHONPATH for that interpreter")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per stream count (the median is reported)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (XLA uses all)")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="all servers up at once, rounds alternating between them (paired ratios; see measure_interleaved)",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="where the servers' logs go")
    parser.add_argument("--capstan-arg", action="append", default=[], help="an extra `capstan serve` argument")
    args = parser.parse_args()
    if args.servers is None:
        args.servers = ["capstan", "llama-cpp-python" if args.llamacpp_python else "llama-server"]
    gguf = str(Path(args.gguf).absolute()) if args.gguf else str(installed_smollm2())
    started = time.monotonic()
    commands = server_commands(args, gguf)
    print(f"load average at start: {load_average()}", flush=True)
    results = {}
    if args.interleave:
        processes: dict[str, tuple[subprocess.Popen, int]] = {}
        try:
            for name, (command, ready, env, cwd) in commands.items():
                port = free_port()
                command = [*command, "--host", "127.0.0.1", "--port", str(port)]
                processes[name] = (start_server(name, command, port, ready, args, env, cwd), port)
            before = load_average()
            servers = {name: (f"http://127.0.0.1:{port}", p.pid) for name, (p, port) in processes.items()}
            results = asyncio.run(measure_interleaved(servers, args))
            for name in results:
                results[name]["load"] = (before, load_average())
        finally:
            for process, _ in processes.values():
                stop_server(process)
    else:
        for name, (command, ready, env, cwd) in commands.items():
            port = free_port()
            command = [*command, "--host", "127.0.0.1", "--port", str(port)]
            results[name] = run_server(name, command, port, ready, args, env, cwd)
    print_table(results, gguf, args)
    print(f"took {time.monotonic() - started:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
