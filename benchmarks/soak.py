"""Soak: N minutes of mixed traffic with disconnects against `capstan serve`, printing the server's RSS and the
latency percentiles each minute, so a leak shows as a slope. Not a CI test: run it by hand.

    python benchmarks/soak.py --minutes 10                      # starts `capstan serve` (embedded model) itself
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --minutes 10

Traffic (fixed seed): completions and chat, streaming and not, 1-200 prompt words, 1-64 output tokens, greedy
and sampled, some with logprobs and n=2; a fifth of the clients disconnect mid-request. Only 127.0.0.1 targets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import TypedDict
from urllib.parse import urlparse

import httpx


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else float("nan"))


def request_body(rng: random.Random) -> tuple[str, dict]:
    words = " ".join(
        rng.choice(["alpha", "beta", "gamma", "delta", "río", "日本", "x"]) for _ in range(rng.randint(1, 200))
    )
    sampling = {
        "max_tokens": rng.randint(1, 64),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "top_p": rng.choice([1.0, 0.9]),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.2:
        sampling["n"] = 2
    if rng.random() < 0.5:
        if rng.random() < 0.2:
            sampling["logprobs"] = rng.randint(0, 5)
        return "/v1/completions", {"prompt": words, **sampling}
    if rng.random() < 0.2:
        sampling |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": words}], **sampling}


class Stats(TypedDict):
    latency: list[float]  # seconds of each request this minute
    errors: int
    disconnected: int


async def client(url: str, rng: random.Random, http: httpx.AsyncClient, stats: Stats, stop_at: float) -> None:
    while time.monotonic() < stop_at:
        path, body = request_body(rng)
        leaves = rng.random() < 0.2
        started = time.monotonic()
        try:
            if body["stream"]:
                async with http.stream("POST", url + path, json=body) as r:
                    events = 0
                    async for line in r.aiter_lines():
                        events += line.startswith("data: ")
                        if leaves and events >= rng.randint(1, 4):
                            break
                    status = r.status_code
            else:
                if leaves:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(http.post(url + path, json=body), timeout=rng.uniform(0.01, 0.3))
                    status = 0
                else:
                    status = (await http.post(url + path, json=body)).status_code
        except httpx.HTTPError:
            status = -1
        if leaves:
            stats["disconnected"] += 1
        elif status == 200:
            stats["latency"].append(time.monotonic() - started)
        else:
            stats["errors"] += 1


async def soak(url: str, pid: int, minutes: float, concurrency: int, seed: int) -> None:
    rngs = [random.Random(seed + i) for i in range(concurrency)]
    stats: Stats = {"latency": [], "errors": 0, "disconnected": 0}
    start = time.monotonic()
    stop_at = start + minutes * 60
    samples = []
    async with httpx.AsyncClient(timeout=120) as http:
        tasks = [asyncio.ensure_future(client(url, rng, http, stats, stop_at)) for rng in rngs]
        print(f"{'min':>5} {'RSS MiB':>8} {'done':>6} {'p50 s':>7} {'p99 s':>7} {'errors':>6} {'left':>5}")
        minute = 0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(1)
            if time.monotonic() - start >= (minute + 1) * 60 or all(t.done() for t in tasks):
                minute += 1
                lat, rss = stats["latency"], rss_mib(pid)
                samples.append((minute, rss))
                print(
                    f"{minute:5d} {rss:8.0f} {len(lat):6d} {percentile(lat, 50):7.3f} {percentile(lat, 99):7.3f} "
                    f"{stats['errors']:6d} {stats['disconnected']:5d}",
                    flush=True,
                )
                stats["latency"] = []
        metrics = (await http.get(url + "/metrics")).text
    half = samples[len(samples) // 2 :]
    if len(half) >= 2:
        xs, ys = [m for m, _ in half], [r for _, r in half]
        slope = statistics.linear_regression(xs, ys).slope
        print(
            f"RSS slope over the second half: {slope:+.2f} MiB/min (start {samples[0][1]:.0f}, "
            f"end {samples[-1][1]:.0f} MiB)"
        )
    for name in (
        "capstan_requests_running",
        "capstan_requests_waiting",
        "capstan_kv_pages_free",
        "capstan_kv_pages_total",
    ):
        line = next((ln for ln in metrics.splitlines() if ln.startswith(name + " ")), f"{name} ?")
        print(line)


def launch(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "capstan.runtime.cli",
        "serve",
        *args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("capstan serve exited before it was ready")
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("capstan serve was not ready within 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server on 127.0.0.1 (with --pid)")
    parser.add_argument("--pid", type=int, help="the server's process id, for its RSS")
    parser.add_argument("--model", nargs="*", default=[], help="MODEL for the launched server (default: embedded)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    proc = None
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost") or args.pid is None:
            raise SystemExit("--url must be a 127.0.0.1/localhost server, given with its --pid")
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url = launch(args)
        pid = proc.pid
    try:
        asyncio.run(soak(url, pid, args.minutes, args.concurrency, args.seed))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
