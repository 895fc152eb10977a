"""The first minute (issue 63): seconds from starting `capstan serve` until /ready answers 200 and until the first
chat answer arrives, with empty caches (the first start of a model: no compiled programs, no GGUF index; the native
CPU kernels that `make setup` built are linked in) and then with what that start left (every later start), `--rounds`
times each. The question is asked at the API's defaults; each start is stopped once its background compilation is
done (`capstan_programs_compiling` 0, at most 900 s).

    python3 benchmarks/first_answer.py [--model PATH] [--rounds 2] [-- more capstan serve flags]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def programs_compiling(url: str) -> int:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    gauge = [line.split()[1] for line in metrics.splitlines() if line.startswith("capstan_programs_compiling")]
    return int(float(gauge[0])) if gauge else 0  # (servers before the background warm-up have no such gauge)


# the native CPU kernels `make setup` built: the cache folder holds them too, and a user's first start has them
BUILT_KERNELS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "capstan" / "kernels"


def one_start(cache: Path, model: list[str], flags: list[str], log: Path) -> dict:
    """cache: the start's XDG_CACHE_HOME (its compiled programs, its GGUF file's index), empty for a first start
    but for the native kernels, linked in as `make setup` left them."""
    kernels = cache / "capstan" / "kernels"
    if BUILT_KERNELS.is_dir() and not kernels.exists():
        kernels.parent.mkdir(parents=True, exist_ok=True)
        kernels.symlink_to(BUILT_KERNELS)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "JAX_COMPILATION_CACHE_DIR": str(cache / "capstan" / "xla")}
    env.pop("CAPSTAN_BAKED_PROGRAMS", None)
    command = [sys.executable, "-m", "capstan.runtime.cli", "serve", *model, "--port", str(port), *flags]
    t0 = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            if server.poll() is not None:  # (the log's folder goes with the run: show its end)
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
                raise SystemExit(f"capstan serve exited ({server.returncode}); the end of its log:\n{tail}")
            if time.monotonic() - t0 > 600:
                raise SystemExit(
                    f"not ready within 600 s; the end of its log:\n{log.read_text(errors='replace')[-3000:]}"
                )
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        ready = time.monotonic() - t0
        name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": name, "messages": [{"role": "user", "content": QUESTION}]}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
        answered = time.monotonic() - t0
        compiling = programs_compiling(url)
        # the start ends as a user's would: once the background is done (every program compiled and kept), so a
        # later start finds all of them, not only those an early stop left
        while programs_compiling(url) and time.monotonic() - t0 < 900:
            time.sleep(1)
        settled = time.monotonic() - t0
        choice = answer["choices"][0]
        return {
            "settled_s": settled,
            "ready_s": ready,
            "answer_s": answered,
            "tokens": answer["usage"]["completion_tokens"],
            "finish": choice["finish_reason"],
            "text": choice["message"]["content"],
            "compiling_after": compiling,
        }
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint (default: capstan serve's default model)")
    ap.add_argument("--rounds", type=int, default=2, help="cold and warm starts, each with a new empty cache")
    ap.add_argument("flags", nargs="*", help="more capstan serve flags (after --)")
    a = ap.parse_args()
    model = [a.model] if a.model else []
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="capstan-first-answer-") as tmp:
        for r in range(a.rounds):
            cache = Path(tmp) / f"cache-{r}"
            for kind in ("cold", "warm"):
                run = one_start(cache, model, a.flags, Path(tmp) / f"serve-{r}-{kind}.log")
                runs[kind].append(run)
                print(
                    f"{kind} start {r + 1}: ready {run['ready_s']:.1f} s, first answer {run['answer_s']:.1f} s "
                    f"({run['tokens']} tokens, {run['finish']}; {run['compiling_after']} programs still "
                    f"compiling then, none after {run['settled_s']:.0f} s): {run['text']!r}",
                    flush=True,
                )
    for kind, done in runs.items():
        print(
            f"{kind}: ready median {statistics.median(r['ready_s'] for r in done):.1f} s, first answer median "
            f"{statistics.median(r['answer_s'] for r in done):.1f} s over {len(done)} starts"
        )


if __name__ == "__main__":
    main()
