"""Prefix-aware routing (prompt hashing, and KV-event scores) against round robin, side by side in one run, on real
`capstan serve` replicas.

    python benchmarks/gateway_prefix.py [--replicas 2] [--groups 16] [--per-group 4] [--concurrency 4]
        [--shared-prefix-words 0]

Starts N replicas of the embedded tiny model on 127.0.0.1, each publishing its prefix cache's KV events
(--kv-events-config), and three gateways in front of the same replicas (`--routing round-robin`, `prefix`,
`kv-events`). The workload: G groups of requests, each group sharing a long
prefix (a document or system prompt) followed by a short question of its own, sent in a shuffled order by a few
concurrent streaming clients. Each policy gets its own fresh prefixes (so neither finds the other's in the caches),
and runs in turn. Reported for each: the replicas' prefix-cache hit rate over that phase (hit tokens / looked-up
tokens, from their /metrics) and time to first token p50/p90 measured by the client.

The regime that matters in production is a working set of prefixes larger than one replica's KV cache but not
than all of theirs: round robin copies every prefix onto every replica and evicts, prefix routing partitions them.
--num-pages sizes each replica's cache (default 448 pages of 16 tokens: 16 prefixes of ~600 tokens need ~610
pages on every replica under round robin, ~300 on each of 2 under prefix routing).

--shared-prefix-words puts one system prompt of that many words before every document (fresh for each policy):
prompt hashing keys on the leading --prefix-chars characters, which the shared part then fills, so it sees one
prefix; KV-event scores see each document's pages.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gateway"))
from processes import free_port, metric, start_gateway, start_replica  # noqa: E402  (the tests' process helpers)

POLICIES = ("round-robin", "prefix", "kv-events")

WORDS = [
    "time",
    "year",
    "people",
    "way",
    "day",
    "thing",
    "world",
    "school",
    "state",
    "family",
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
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
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
    "team",
    "minute",
    "idea",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "level",
    "office",
    "door",
]


def workload(seed: int, groups: int, per_group: int, prefix_words: int, shared_words: int = 0) -> list[str]:
    rng = random.Random(seed)
    shared = (
        f"System {seed}: " + " ".join(rng.choice(WORDS) for _ in range(shared_words)) + "\n" if shared_words else ""
    )
    prompts = []
    for g in range(groups):
        prefix = f"{shared}Document {seed}-{g}: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        prompts += [f"{prefix}\nQuestion {q}: what is the {rng.choice(WORDS)}?" for q in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def ttft(url: str, prompt: str) -> float:
    start = time.perf_counter()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        first = None
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no token came back")
    return first


def cache_counters(replicas) -> tuple[float, float]:
    return (
        sum(metric(r.url, "capstan_prefix_cache_hit_tokens_total") for r in replicas),
        sum(metric(r.url, "capstan_prefix_cache_queried_tokens_total") for r in replicas),
    )


def run_phase(gateway_url: str, replicas, prompts: list[str], concurrency: int) -> dict:
    hits0, queried0 = cache_counters(replicas)
    with ThreadPoolExecutor(concurrency) as pool:
        times = sorted(pool.map(lambda p: ttft(gateway_url, p), prompts))
    hits1, queried1 = cache_counters(replicas)
    return {
        "hit_rate": (hits1 - hits0) / max(queried1 - queried0, 1),
        "ttft_p50": statistics.median(times),
        "ttft_p90": times[int(0.9 * (len(times) - 1))],
        "requests": len(times),
    }


def kv_events_config() -> str:
    endpoint, replay = f"tcp://*:{free_port()}", f"tcp://*:{free_port()}"
    return json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--prefix-words", type=int, default=300)
    parser.add_argument("--shared-prefix-words", type=int, default=0, help="a system prompt shared by every group")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--load-factor", default="1.25", help="the prefix gateway's --load-factor")
    parser.add_argument("--num-pages", default="448", help="KV-cache pages of each replica (16 tokens each)")
    args = parser.parse_args()

    replicas = [
        start_replica("tiny", extra=["--num-pages", args.num_pages, "--kv-events-config", kv_events_config()])
        for _ in range(args.replicas)
    ]
    gateways = []
    try:
        for r in replicas:
            r.wait_ready()
        urls = [f"tiny={r.url}" for r in replicas]
        gateways = [
            start_gateway(
                urls, "--routing", policy, "--poll-interval", "0.5", "--load-factor", args.load_factor
            ).wait_ready(30)
            for policy in POLICIES
        ]
        ttft(gateways[0].url, "warm-up " * 50)  # any lazily compiled shape, outside the measurements
        print(
            f"{args.replicas} replicas, {args.groups} prefix groups x {args.per_group} requests, "
            f"{args.shared_prefix_words}-word shared system prompt + {args.prefix_words}-word documents, "
            f"{args.concurrency} concurrent clients, load factor {args.load_factor}, "
            f"{args.num_pages} KV pages per replica"
        )
        print(
            f"{'routing':<12} {'requests':>8} {'prefix-cache hit rate':>22} {'TTFT p50 (ms)':>14} {'TTFT p90 (ms)':>14}"
        )
        for seed, (policy, gateway) in enumerate(zip(POLICIES, gateways, strict=True), start=1):
            prompts = workload(seed, args.groups, args.per_group, args.prefix_words, args.shared_prefix_words)
            result = run_phase(gateway.url, replicas, prompts, args.concurrency)
            print(
                f"{policy:<12} {result['requests']:>8} {result['hit_rate']:>22.1%} "
                f"{result['ttft_p50'] * 1000:>14.1f} {result['ttft_p90'] * 1000:>14.1f}",
                flush=True,
            )
    finally:
        for process in gateways + replicas:
            process.stop()


if __name__ == "__main__":
    main()
