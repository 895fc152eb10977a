"""Online against offline in one run: `capstan serve` on a random checkpoint of a named shape, loaded by HTTP
clients, then the offline LLMEngine with the same engine flags on prompts of the same lengths.

    python benchmarks/online.py --shape tiny --requests 16 --prompt-len 32 --output-len 32 --max-num-seqs 16 \
        --max-num-batched-tokens 256 --smallest-bucket 16 --single-stream-tokens 32 --workload-scale 0.2
    python benchmarks/online.py --shape llama-3.2-1b          # the H100 targets (benchmarks/gpu_suite.sh serve)

1. Writes the shape as a Hugging Face folder (random_checkpoint.py; reused when already there).
2. Starts `capstan serve` (its own process group), waits for /ready, and measures: one stream's ms a token; N
   concurrent requests of exactly --prompt-len token ids -> --output-len tokens (ignore_eos) streamed, from each
   --client-processes count (equal figures show the client is not the bottleneck; each client process's CPU
   share is printed too), and not streamed; then benchmarks/serve.py's workloads. Then it stops the server.
3. Builds the offline engine from the same flags (the server's own flag parser, so the same EngineConfig) and
   runs the same prompt sets with detokenize=True (what the server does) and detokenize=False.
Only step 3 starts JAX in this process: the server holds the accelerator alone while it runs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import serve  # noqa: E402  (the load client: benchmarks/serve.py)
from proc_usage import Usage  # noqa: E402

from capstan.runtime.server.frontend_count import frontends_for, host_cpus, host_has_accelerator  # noqa: E402

WARMUP_REQUESTS = 8
ADAPTER = "adapter0"  # --lora-rank's adapter, as benchmarks/lora.py names it
SINGLE_STREAMS = 3  # one stream's figure: the median of this many requests, one after another


# ---- the server ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`capstan serve` as a child in its own process group: ready within `timeout` s, else an error with its log.
    Ready: `frontends` x 2 answers of /ready in a row, each on a new connection, which the kernel spreads over
    the frontends sharing the port (each turns ready on its own)."""

    def __init__(self, serve_argv: list[str], log_path: Path, timeout: float, frontends: int = 1):
        self.argv, self.log_path, self.timeout, self.frontends = serve_argv, log_path, timeout, frontends
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        cmd = [
            sys.executable,
            "-m",
            "capstan.runtime.cli",
            "serve",
            *self.argv,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        print("$", shlex.join(cmd), flush=True)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        t0, deadline, streak = time.monotonic(), time.monotonic() + self.timeout, 0
        try:
            while streak < 2 * self.frontends:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"capstan serve exited ({self.proc.returncode}) before ready:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"capstan serve not ready after {self.timeout:.0f} s:\n{self.log_tail()}")
                try:
                    streak = streak + 1 if httpx.get(self.url + "/ready", timeout=2).status_code == 200 else 0
                except httpx.HTTPError:
                    streak = 0
                time.sleep(0.5 if streak == 0 else 0.05)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        self.compiled_s = self.wait_compiled(t0, deadline)
        return self

    def wait_compiled(self, t0: float, deadline: float) -> float:
        """Seconds from start until the warm-up's background compilation ended (capstan_programs_compiling 0): the
        figures below are of every program compiled, not of stand-ins."""
        while time.monotonic() < deadline:
            metrics = httpx.get(self.url + "/metrics", timeout=10).text
            found = re.search(r"^capstan_programs_compiling (\S+)$", metrics, re.M)
            if found is None or float(found.group(1)) == 0:
                return time.monotonic() - t0
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"capstan serve still compiling after {self.timeout:.0f} s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM (the server drains, then stops its core), then SIGKILL to whatever of the group is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                print("capstan serve did not stop within 60 s of SIGTERM: killed", flush=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children left behind, if any
        self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_problems(self) -> list[str]:
        """The log's errors, warnings and tracebacks (what a clean run should not have)."""
        return [
            line
            for line in self.log_path.read_text(errors="replace").splitlines()
            if any(w in line for w in (" ERROR ", " WARNING ", "Traceback", "Error:"))
        ]


# ---- load clients in their own processes ----------------------------------------------------------------------
def _client_process(job: dict, ready, go, results) -> None:
    asyncio.run(_client_requests(job, ready, go, results))


async def _client_requests(job: dict, ready, go, results) -> None:
    client = serve.Client(
        argparse.Namespace(
            url=job["url"],
            api_key=None,
            timeout=job["timeout"],
            model=job["model"],
            endpoint="completions",
            ignore_eos=True,
        )
    )
    try:
        ready.put(os.getpid())
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        cpu0, wall0 = time.process_time(), time.monotonic()
        if job["sequential"]:
            done = [await client.request(p, job["max_tokens"], job["stream"]) for p in job["prompts"]]
        else:
            done = await asyncio.gather(*(client.request(p, job["max_tokens"], job["stream"]) for p in job["prompts"]))
        wall = time.monotonic() - wall0
        results.put(
            {
                "results": [dataclasses.asdict(r) for r in done],
                "cpu_percent": 100 * (time.process_time() - cpu0) / wall if wall else None,
            }
        )
    finally:
        await client.http.aclose()


def load(
    url: str,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    stream: bool = True,
    processes: int = 1,
    sequential: bool = False,
    timeout: float = 600.0,
    sid: int | None = None,
) -> dict:
    """Sends the prompts (all at once, or one after another) from `processes` client processes started together;
    serve.summarize of all of them, with each process's CPU share, and the server's (session sid) and the host's CPU
    and the GPUs' busy share while they ran (proc_usage.py)."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no state of this one (nor JAX) is inherited
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    jobs = [
        dict(
            url=url,
            model=model,
            prompts=prompts[i::processes],
            max_tokens=max_tokens,
            stream=stream,
            sequential=sequential,
            timeout=timeout,
        )
        for i in range(processes)
    ]
    procs = [ctx.Process(target=_client_process, args=(job, ready, go, results), daemon=True) for job in jobs]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        with Usage(sid) as usage:
            go.set()
            parts = [results.get(timeout=timeout * (len(prompts) if sequential else 1) + 120) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    done = [serve.Result(**r) for part in parts for r in part["results"]]
    duration = max(r.start + (r.e2e or 0) for r in done) - min(r.start for r in done)
    return {
        **serve.summarize(done, duration),
        "client_processes": processes,
        "client_cpu_percent": [part["cpu_percent"] for part in parts],
        "ms_per_token": [1000 * r.e2e / r.output_tokens for r in done if r.ok],
        "usage": usage.result,
        "usage_line": usage.line(),
    }


# ---- the offline engine ---------------------------------------------------------------------------------------
class FirstTokens:
    """The engine as throughput.run drives it, noting when each request's first token came out."""

    def __init__(self, engine):
        self._engine, self.start, self.first = engine, None, {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request_id, prompt, params, lora_request=None) -> None:
        self.start = self.start or time.perf_counter()
        self._engine.add_request(request_id, prompt, params, lora_request=lora_request)

    def step(self):
        outs = self._engine.step()
        now = time.perf_counter()
        for r in outs:
            if r.request_id not in self.first and any(o.token_ids for o in r.outputs):
                self.first[r.request_id] = now - self.start
        return outs

    def take_ttft(self) -> list[float]:
        ttft, self.start, self.first = list(self.first.values()), None, {}
        return ttft


def offline(serve_argv: list[str], sets: dict, a: argparse.Namespace) -> dict:
    """The offline engine on the same EngineConfig as the server (its flags through capstan's own parser)."""
    from throughput import run

    from capstan.runtime.cli import _engine_config, build_parser
    from capstan.runtime.compilation_cache import persist_compilations
    from capstan.runtime.engine.engine import LLMEngine
    from capstan.runtime.lora.request import LoRARequest
    from capstan.runtime.sampling.sampling_params import SamplingParams

    persist_compilations()  # the server's compilation cache: the same programs load instead of compiling
    config = _engine_config(build_parser().parse_args(["serve", *serve_argv]))
    t0 = time.perf_counter()
    engine = FirstTokens(LLMEngine(config))
    if config.warmup:
        engine.warmup()
    figures: dict = {"engine_ready_s": time.perf_counter() - t0}
    run(engine, sets["warmup"], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    engine.take_ttft()
    for detok in (True, False):
        key = f"offline detokenize={detok}"
        params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0, detokenize=detok)
        fig = run(engine, sets["offline-detok" if detok else "offline-nodetok"], params)
        fig["ttft_s"] = serve.percentiles(engine.take_ttft())
        one = dataclasses.replace(params, max_tokens=a.single_stream_tokens)
        if a.single_stream_tokens:
            fig.update(single_streams(engine, sets["single"], one))
        if a.single_stream_tokens and a.lora_rank and detok:  # the same streams on the adapter, as the server runs
            figures["lora one stream, offline"] = single_streams(
                engine, sets["single"], one, LoRARequest(ADAPTER, 1, a.lora_path)
            )
        figures[key] = fig
        print(
            f"{key}: {fig['output_tokens_per_s']:.1f} output tok/s, prefill phase {fig['prefill_phase_s']:.3f} s",
            flush=True,
        )
    return figures


def single_streams(engine, prompts: list[list[int]], params, lora=None) -> dict:
    """One request at a time: the median's ms a token (whole request) and after its first token."""
    from throughput import run

    singles = []
    for p in prompts:
        s = run(engine, [p], params, loras=[lora] if lora else None)
        ttft = engine.take_ttft()[0]
        singles.append(
            (1000 * s["seconds"] / s["output_tokens"], 1000 * (s["seconds"] - ttft) / max(1, s["output_tokens"] - 1))
        )
    ms, tpot = sorted(singles)[len(singles) // 2]
    return {"single_stream_ms_per_token": ms, "single_stream_tpot_ms": tpot}


# ---- the run --------------------------------------------------------------------------------------------------
def prompt_sets(a: argparse.Namespace, id_limit: int, id_low: int = 0) -> dict[str, list[list[int]]]:
    """Token-id prompts, a fresh set for each measured run (no run hits another's prefix cache); the offline
    runs get the sets of the first two online streaming runs."""
    import numpy as np

    def fresh(seed: int, count: int, length: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [rng.integers(id_low, id_limit, length).tolist() for _ in range(count)]

    sets = {
        "warmup": fresh(99, WARMUP_REQUESTS, a.prompt_len),
        "single": fresh(98, SINGLE_STREAMS, a.prompt_len),
        "single-online": fresh(97, SINGLE_STREAMS, a.prompt_len),
        "whole": fresh(50, a.requests, a.prompt_len),
    }
    for i in range(len(a.client_processes)):
        sets[f"stream-{i}"] = fresh(i, a.requests, a.prompt_len)
    sets["offline-detok"] = sets["stream-0"]
    sets["offline-nodetok"] = (
        sets[f"stream-{min(1, len(a.client_processes) - 1)}"]
        if len(a.client_processes) > 1
        else fresh(51, a.requests, a.prompt_len)
    )
    return sets


def online(server: Server, sets: dict, a: argparse.Namespace) -> dict:
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    go = dict(url=server.url, model=model, timeout=a.request_timeout, sid=server.proc.pid if server.proc else None)
    figures: dict = {"server_ready_s": server.ready_s, "server_compiled_s": server.compiled_s}
    load(prompts=sets["warmup"], max_tokens=4, **go)
    load(prompts=sets["warmup"], max_tokens=4, stream=False, **go)
    if a.single_stream_tokens:

        def one_stream(model: str) -> dict:  # the prompts one after another: the median's figures
            one = load(
                prompts=sets["single-online"],
                max_tokens=a.single_stream_tokens,
                sequential=True,
                **{**go, "model": model},
            )
            return {
                "single_stream_ms_per_token": sorted(one["ms_per_token"])[len(one["ms_per_token"]) // 2],
                "single_stream_tpot_ms": 1000 * one["tpot_s"]["p50"] if one["tpot_s"]["p50"] else None,
            }

        figures.update(one_stream(model))
        if a.lora_rank:  # the same streams on the adapter (request's model), the base's above on the same server
            figures["lora"] = one_stream(ADAPTER)
    for i, n in enumerate(a.client_processes):
        key = f"online stream, {n} client process{'es' if n > 1 else ''}"
        figures[key] = load(prompts=sets[f"stream-{i}"], max_tokens=a.output_len, processes=n, **go)
        _say(key, figures[key])
    key = f"online whole responses, {a.client_processes[-1]} client processes"
    figures[key] = load(
        prompts=sets["whole"], max_tokens=a.output_len, stream=False, processes=a.client_processes[-1], **go
    )
    _say(key, figures[key])
    if a.workloads:
        print("benchmarks/serve.py workloads (text prompts, ignore_eos):", flush=True)
        args = argparse.Namespace(
            url=server.url,
            model=model,
            api_key=None,
            endpoint="completions",
            workloads=a.workloads,
            max_tokens=a.workload_max_tokens,
            ignore_eos=True,
            scale=a.workload_scale,
            timeout=a.request_timeout,
            seed=0,
        )
        figures["workloads"] = asyncio.run(serve.main_async(args))["workloads"]
    return figures


def _say(key: str, s: dict) -> None:
    failed = f", {s['requests'] - s['successes']} FAILED: {s['first_error']}" if s["successes"] < s["requests"] else ""
    print(
        f"{key}: {s['output_tokens_per_s'] or 0:.1f} output tok/s, client CPU "
        f"{'/'.join(f'{c:.0f}%' for c in s['client_cpu_percent'])}{failed}\n  {s['usage_line']}",
        flush=True,
    )


def table(report: dict) -> None:
    def ms(v) -> str:
        return "-" if v is None else f"{1000 * v:.1f}"

    runs = {
        k: v
        for k, v in {**report.get("online", {}), **report.get("offline", {})}.items()
        if k.startswith(("online ", "offline "))
    }
    base = report.get("offline", {}).get("offline detokenize=True", {}).get("output_tokens_per_s")
    print(
        f"\n{'run':44s} {'out tok/s':>10s} {'/offline':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} "
        f"{'ITL p99':>8s} {'TPOT p50':>9s}  notes (ms; /offline: over offline detokenize=True)"
    )
    for key, s in runs.items():
        tps = s.get("output_tokens_per_s") or 0
        ratio = f"{tps / base:.3f}" if base else "-"
        if key.startswith("offline"):
            notes = f"prefill phase {s['prefill_phase_s'] * 1000:.0f}, {s['steps']} steps"
            print(
                f"{key:44s} {tps:10.1f} {ratio:>8s} {ms(s['ttft_s']['p50']):>9s} {ms(s['ttft_s']['p99']):>9s} "
                f"{'-':>8s} {'-':>8s} {'-':>9s}  {notes}"
            )
            continue
        notes = f"{s['successes']}/{s['requests']} ok, client CPU " + "/".join(
            f"{c:.0f}%" for c in s["client_cpu_percent"]
        )
        print(
            f"{key:44s} {tps:10.1f} {ratio:>8s} {ms(s['ttft_s']['p50']):>9s} {ms(s['ttft_s']['p99']):>9s} "
            f"{ms(s['itl_s']['p50']):>8s} {ms(s['itl_s']['p99']):>8s} {ms(s['tpot_s']['p50']):>9s}  {notes}"
        )
    singles = [
        (k, v)
        for k, v in (
            ("online stream", report.get("online", {})),
            ("lora one stream, online", report.get("online", {}).get("lora")),
            *report.get("offline", {}).items(),
        )
        if isinstance(v, dict) and v.get("single_stream_ms_per_token")
    ]
    online_figures = report.get("online", {})
    if "server_ready_s" in online_figures:
        print(
            f"capstan serve, {report['api_server_count']} frontend(s): ready {online_figures['server_ready_s']:.1f} s "
            f"after start, every program compiled {online_figures['server_compiled_s']:.1f} s after start"
        )
    if singles:
        print(
            "one stream, ms a token (whole request / after the first token): "
            + ", ".join(
                f"{k} {v['single_stream_ms_per_token']:.3f} / {v['single_stream_tpot_ms'] or 0:.3f}" for k, v in singles
            )
        )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", help="a benchmarks/shapes.py name (Llama or Qwen3)")
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="serve this checkpoint folder or .gguf file (e.g. the default model's) instead of a random shape",
    )
    ap.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="folder for the random checkpoint (default: /tmp/capstan-online-SHAPE; reused)",
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--single-stream-tokens", type=int, default=256, help="one stream's output tokens (0: skip)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--smallest-bucket", type=int, default=256, help="capstan serve --smallest-token-bucket")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--api-server-count", default="auto", help="the server's frontends: a count, or auto (the server's default)"
    )
    ap.add_argument(
        "--client-processes",
        type=int,
        nargs="+",
        default=[1, 2],
        help="a streaming run from each of these many client processes",
    )
    ap.add_argument(
        "--server-args",
        default="",
        help="more `capstan serve` flags, one string (the offline engine gets the engine flags among them too); "
        "write --server-args=--flag when it is one flag with no value (argparse reads a lone --flag as an option)",
    )
    ap.add_argument("--workloads", default=",".join(serve.WORKLOADS), help="benchmarks/serve.py workloads ('' none)")
    ap.add_argument("--workload-scale", type=float, default=1.0, help="their request counts times this")
    ap.add_argument("--workload-max-tokens", type=int, default=128)
    ap.add_argument("--phases", nargs="+", choices=["online", "offline"], default=["online", "offline"])
    ap.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds for the server to load and compile")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="serve a random PEFT adapter of this rank on all seven projections too (--enable-lora, one slot): one "
        "stream on it beside the base's, online and offline (0: none)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    a = ap.parse_args(argv)
    unknown = set(filter(None, a.workloads.split(","))) - set(serve.WORKLOADS)
    if unknown:
        ap.error(f"--workloads: unknown {sorted(unknown)}; choose from {', '.join(serve.WORKLOADS)}")
    if min(a.client_processes) < 1:
        ap.error("--client-processes: each count must be at least 1")
    from random_checkpoint import write_checkpoint

    t0 = time.perf_counter()
    if a.model is not None:  # a real checkpoint: prompts of its tokenizer's ordinary pieces, above its specials
        from capstan.runtime.tokenizer import Tokenizer

        ckpt, tokenizer = a.model, Tokenizer.from_pretrained(a.model)
        sets = prompt_sets(a, id_limit=tokenizer.vocab_size, id_low=max(tokenizer.special_token_ids) + 1)
    else:
        ckpt = write_checkpoint(a.shape, a.checkpoint or Path(f"/tmp/capstan-online-{a.shape}"))
        added = json.loads((ckpt / "tokenizer.json").read_text())["added_tokens"]
        sets = prompt_sets(a, id_limit=min(t["id"] for t in added))  # the BPE's own pieces, below its specials
    print(f"checkpoint {ckpt} ({time.perf_counter() - t0:.1f} s)", flush=True)
    lora_argv = []
    if a.lora_rank:  # numpy only here: the server holds the accelerator alone while it runs
        from lora import write_adapters

        from capstan.runtime.models.config import ModelConfig

        folder = Path(tempfile.mkdtemp(prefix="capstan-online-adapter-"))
        a.lora_path = write_adapters(folder, ModelConfig.from_pretrained(ckpt), 1, a.lora_rank)[0].lora_path
        lora_argv = ["--enable-lora", "--lora-modules", f"{ADAPTER}={a.lora_path}", "--max-lora-rank", str(a.lora_rank)]
    serve_argv = [
        str(ckpt),
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--max-num-batched-tokens",
        str(a.max_num_batched_tokens),
        "--smallest-token-bucket",
        str(a.smallest_bucket),
        "--max-model-len",
        str(a.max_model_len),
        *lora_argv,
        *shlex.split(a.server_args),
    ]
    report: dict = {
        "shape": str(a.model) if a.model else a.shape,
        "requests": a.requests,
        "prompt_len": a.prompt_len,
        "output_len": a.output_len,
        "api_server_count": a.api_server_count,
        "serve_argv": serve_argv,
    }
    if "online" in a.phases:
        log = Path(f"/tmp/capstan-online-server-{os.getpid()}.log")
        frontends = frontends_for(host_cpus(), host_has_accelerator()) if a.api_server_count == "auto" else None
        count = ["--api-server-count", a.api_server_count] if frontends is None else []  # auto: the default, unsaid
        report["api_server_count"] = frontends or int(a.api_server_count)
        with Server([*serve_argv, *count], log, a.ready_timeout, report["api_server_count"]) as server:
            report["online"] = online(server, sets, a)
        problems = server.log_problems()
        report["server_log"], report["server_log_problems"] = str(log), problems
        print(f"server log {log}: {len(problems)} error/warning lines" + "".join(f"\n  {p}" for p in problems[:10]))
    if "offline" in a.phases:
        report["offline"] = offline(serve_argv, sets, a)
        import jax

        report["device"] = str(jax.devices()[0].device_kind)
    table(report)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1, default=str))
        print(f"report written to {a.json}")
    return report


if __name__ == "__main__":
    main()
