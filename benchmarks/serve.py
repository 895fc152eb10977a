"""Online load generator for any OpenAI-compatible server (Capstan, or a peer such as vLLM on the same model).

    python benchmarks/serve.py --url http://127.0.0.1:8000 [--workloads sequential,burst] [--output report.json]

Each named workload streams requests at its arrival pattern and reports successes, time to first token (TTFT),
time per output token after the first (TPOT), the gaps between text chunks as the client reads them (ITL),
end-to-end latency (p50/p90/p99) and output tokens/s. benchmarks/online.py drives it against `capstan serve` on a
random checkpoint and against the offline engine on the same prompts. Prompts
are synthetic words; the words-per-token ratio of the server's tokenizer is measured first, so the prompt
lengths below are in the served model's tokens whatever its tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time

import httpx

WORDS = [
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
]


@dataclasses.dataclass
class Workload:
    name: str
    requests: int
    rate: float  # arrivals per second; math.inf: all at once; 0: one at a time, each after the last finished
    prompt_tokens: int = 256
    long_prompt_tokens: int = 0  # with long_fraction: that share of the prompts are this long instead
    long_fraction: float = 0.0
    shared_prefix_tokens: int = 0  # every prompt starts with the same text of this length


WORKLOADS = {
    "sequential": Workload("sequential", requests=10, rate=0),
    "staggered": Workload("staggered", requests=32, rate=4),
    "burst": Workload("burst", requests=48, rate=math.inf),
    "long_prompts": Workload(
        "long_prompts", requests=36, rate=6, prompt_tokens=128, long_prompt_tokens=1536, long_fraction=0.75
    ),
    "shared_prefix": Workload("shared_prefix", requests=48, rate=8, prompt_tokens=64, shared_prefix_tokens=1024),
}


@dataclasses.dataclass
class Result:
    status: int = 0
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    itl: list[float] = dataclasses.field(default_factory=list)  # gaps between text chunks (a chunk may hold tokens)
    start: float = 0.0  # time.monotonic() when sent: one clock for every client process of this machine

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.output_tokens > 0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, count)))


class Client:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(
            base_url=args.url.rstrip("/"), headers=headers, limits=limits, timeout=httpx.Timeout(args.timeout)
        )
        self.model = args.model
        self.max_model_len: int | None = None

    async def discover(self) -> None:
        models = (await self.http.get("/v1/models")).raise_for_status().json()["data"]
        card = next((m for m in models if m["id"] == self.model), models[0])
        self.model = self.model or card["id"]
        self.max_model_len = card.get("max_model_len")

    def body(self, prompt: str | list[int], max_tokens: int, stream: bool = True) -> tuple[str, dict]:
        """prompt: text, or token ids (completions only) for exact prompt lengths."""
        extra = {"ignore_eos": True} if self.args.ignore_eos else {}
        common = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
        if stream:
            common["stream_options"] = {"include_usage": True}
        if self.args.endpoint == "chat":
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**common, "prompt": prompt}

    async def request(self, prompt: str | list[int], max_tokens: int, stream: bool = True) -> Result:
        if not stream:
            return await self.request_whole(prompt, max_tokens)
        path, body = self.body(prompt, max_tokens)
        result, chunks_with_text = Result(start=time.monotonic()), 0
        start = time.perf_counter()
        last = start  # the previous text chunk's time; the first chunk's gap is its TTFT, not an ITL
        try:
            async with self.http.stream("POST", path, json=body) as r:
                result.status = r.status_code
                if r.status_code != 200:
                    result.error = (await r.aread()).decode(errors="replace")[:300]
                    return result
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result.error = json.dumps(chunk["error"])[:300]
                    for choice in chunk.get("choices", []):
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            chunks_with_text += 1
                            now = time.perf_counter()
                            if result.ttft is None:
                                result.ttft = now - start
                            else:
                                result.itl.append(now - last)
                            last = now
                    if chunk.get("usage"):
                        result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        result.output_tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as e:
            result.error = f"{type(e).__name__}: {e}"
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks_with_text  # a peer without include_usage
        return result

    async def request_whole(self, prompt: str | list[int], max_tokens: int) -> Result:
        """A non-streaming request: only its end-to-end latency (no TTFT) and its usage."""
        path, body = self.body(prompt, max_tokens, stream=False)
        result = Result(start=time.monotonic())
        start = time.perf_counter()
        try:
            r = await self.http.post(path, json=body)
            result.status = r.status_code
            if r.status_code != 200:
                result.error = r.text[:300]
            else:
                usage = r.json().get("usage") or {}
                result.prompt_tokens = usage.get("prompt_tokens", 0)
                result.output_tokens = usage.get("completion_tokens", 0)
        except httpx.HTTPError as e:
            result.error = f"{type(e).__name__}: {e}"
        result.e2e = time.perf_counter() - start
        return result

    async def tokens_per_word(self) -> float:
        """The served tokenizer's tokens per synthetic word, from the usage of a one-token request."""
        probe = await self.request(words(random.Random(0), 20), 1)
        if not probe.prompt_tokens:
            return 1.3  # no usage reported: a typical BPE ratio for common English words
        return probe.prompt_tokens / 20


def percentiles(values: list[float | None]) -> dict[str, float | None]:
    present = sorted(v for v in values if v is not None)
    if not present:
        return {"p50": None, "p90": None, "p99": None, "mean": None}

    def at(q: float) -> float:
        return present[min(len(present) - 1, max(0, math.ceil(q * len(present)) - 1))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": sum(present) / len(present)}


def prompts_for(w: Workload, tokens_per_word: float, budget: int, seed: int) -> list[str]:
    """Prompts of the workload's lengths (in the model's tokens), capped to fit `budget` tokens in all."""
    rng = random.Random(seed)

    def text(tokens: int) -> str:
        return words(rng, int(tokens / tokens_per_word))

    prefix_tokens = min(w.shared_prefix_tokens, int(budget * 0.75))
    prefix = text(prefix_tokens) + "\n" if prefix_tokens else ""
    room = max(8, budget - prefix_tokens)
    longs = set(rng.sample(range(w.requests), round(w.requests * w.long_fraction)))
    return [
        prefix + text(min(room, w.long_prompt_tokens if i in longs else w.prompt_tokens)) for i in range(w.requests)
    ]


async def run_workload(client: Client, w: Workload, tokens_per_word: float) -> dict:
    max_tokens = client.args.max_tokens
    # Prompts must fit the served context with the output: cap them (the report shows the lengths sent).
    budget = int(((client.max_model_len or 10**9) - max_tokens - 16) * 0.9)
    prompts = prompts_for(w, tokens_per_word, max(16, budget), client.args.seed)
    start = time.perf_counter()
    if w.rate == 0:
        results = [await client.request(p, max_tokens) for p in prompts]
    else:

        async def arrive(i: int, prompt: str) -> Result:
            if w.rate != math.inf:
                await asyncio.sleep(max(0.0, start + i / w.rate - time.perf_counter()))
            return await client.request(prompt, max_tokens)

        results = await asyncio.gather(*(arrive(i, p) for i, p in enumerate(prompts)))
    duration = time.perf_counter() - start
    return {
        "workload": dataclasses.asdict(w) | {"rate": None if w.rate == math.inf else w.rate},
        **summarize(results, duration),
    }


def summarize(results: list[Result], duration: float) -> dict:
    """Successes, failures and latency percentiles of requests that ran over `duration` seconds."""
    ok = [r for r in results if r.ok]
    failures: dict[str, int] = {}
    for r in results:
        if not r.ok:
            failures[str(r.status or "error")] = failures.get(str(r.status or "error"), 0) + 1
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "successes": len(ok),
        "failures": failures,
        "first_error": next((r.error for r in results if r.error), None),
        "duration_s": duration,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / len(ok) if ok else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration if duration else None,
        "requests_per_s": len(ok) / duration if duration else None,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles([r.tpot for r in ok]),
        "itl_s": percentiles([gap for r in ok for gap in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }


def print_row(name: str, s: dict) -> None:
    def ms(d: dict, k: str) -> str:
        return "-" if d[k] is None else f"{d[k] * 1000:8.1f}"

    print(
        f"{name:14s} {s['successes']:3d}/{s['requests']:<3d} "
        f"TTFT p50/p90/p99 ms {ms(s['ttft_s'], 'p50')} {ms(s['ttft_s'], 'p90')} {ms(s['ttft_s'], 'p99')}  "
        f"TPOT p50/p90/p99 ms {ms(s['tpot_s'], 'p50')} {ms(s['tpot_s'], 'p90')} {ms(s['tpot_s'], 'p99')}  "
        f"ITL p50/p99 ms {ms(s['itl_s'], 'p50')} {ms(s['itl_s'], 'p99')}  "
        f"E2E p50/p90/p99 ms {ms(s['e2e_s'], 'p50')} {ms(s['e2e_s'], 'p90')} {ms(s['e2e_s'], 'p99')}  "
        f"{s['output_tokens_per_s'] or 0:8.1f} out tok/s",
        flush=True,
    )


async def main_async(args: argparse.Namespace) -> dict:
    client = Client(args)
    try:
        await client.discover()
        ratio = await client.tokens_per_word()
        report = {
            "url": args.url,
            "model": client.model,
            "endpoint": args.endpoint,
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "max_model_len": client.max_model_len,
            "tokens_per_word": ratio,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "workloads": {},
        }
        for name in args.workloads.split(","):
            w = WORKLOADS[name]
            if args.scale != 1.0:
                w = dataclasses.replace(w, requests=max(1, round(w.requests * args.scale)))
            report["workloads"][name] = summary = await run_workload(client, w, ratio)
            print_row(name, summary)
        return report
    finally:
        await client.http.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --max-tokens (vLLM's extra field; use --no-ignore-eos for OpenAI)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload's request count")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="serve-benchmark.json", help="JSON report path")
    args = parser.parse_args(argv)
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"--workloads: unknown {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    report = asyncio.run(main_async(args))
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"report written to {args.output}")
    return 0 if all(w["successes"] == w["requests"] for w in report["workloads"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
