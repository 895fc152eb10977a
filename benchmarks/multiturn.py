"""Multi-turn conversations with and without the prefix cache's host-memory tier (--kv-offloading-size), in one run.

N conversations of T turns: each turn resends the whole history (the first message, then every answer and user
message so far) plus a new user message, so prompts grow to thousands of tokens. At most --concurrency turns are in
flight; a conversation's next turn queues when its last one ends (round robin, the device cache's worst case). The
device pool is sized to 1/--pool-ratio of the conversations' final working set, so their pages are evicted between
turns: without the tier returning turns are prefilled again, with it their pages come back from host memory.
Random weights of a named shape (no download); the same model serves both engines.

python benchmarks/multiturn.py --shape tiny --conversations 8 --turns 4 --first-len 256 --user-len 64 --output-len 16
prints TTFT p50/p99 of first and returning turns, output and total tokens/s, the tier's hits and bytes and where a
load's time goes (the copy threads' phases, the engine thread's share, start -> landed -> written); --json too.
--break-even 64 256 1024: single requests of those prefix lengths, recomputed against copied back (TTFT each).

Answers: a third engine, "cached", has a device pool that holds every conversation (nothing evicted), so its returning
turns read the very K/V their earlier turns computed, as the tier's do: the tier's greedy answers must equal its
answers token for token (a restored page with wrong bytes would not). Recompute's may differ from both where a
near-tie flips: K/V recomputed in one prefill round differently from K/V computed by earlier prefill chunks and
decode steps (in bf16 most; vLLM's prefix cache has the same property)."""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402

from capstan.runtime.attention import PAGES_INTERLEAVED, layout_of  # noqa: E402
from capstan.runtime.attention.kv_quantization import KV_CACHE_DTYPES, cache_dtype  # noqa: E402
from capstan.runtime.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.kv import host_offload  # noqa: E402
from capstan.runtime.kv.cache import KVCache  # noqa: E402
from capstan.runtime.kv.host_offload import gather_pages  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402


def engine_for(model, a, num_pages: int, tier_gib: float) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(DEFAULT_MODEL),
            dtype=a.dtype,
            max_model_len=a.max_model_len,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            smallest_token_bucket=a.smallest_bucket,
            page_size=a.page_size,
            num_pages=num_pages,
            kv_offloading_size=tier_gib,
            decode_steps_with_room=a.decode_steps_with_room,
            kv_cache_dtype=a.kv_cache_dtype,
        ),
        model=model,
    )
    engine.warmup()
    return engine


class Phases:
    """Where a returning turn's TTFT goes (--phases): sent -> its load started -> pages written -> first scheduled
    -> first token, and the engine steps' wall times (each request's times by its id)."""

    def __init__(self, engine: LLMEngine):
        self.marks: dict[str, dict[str, float]] = collections.defaultdict(dict)
        self.steps: list[float] = []
        self.step_of: dict[str, dict[str, int]] = collections.defaultdict(dict)  # the engine step of each mark
        self.kinds: dict[str, list[float]] = collections.defaultdict(list)  # step wall times by what the step did
        self.first_chunk_whole: dict[str, bool] = {}  # by request id
        # the steps that first schedule a returning turn: ms from the step's start to its schedule's end, from there
        # to the end of the poll that writes its loads (0: none), and from there to the step's end
        self.admitting: list[tuple[float, float, float]] = []
        self._step_marks: dict[str, float] = {}
        sched, offload = engine.scheduler, engine.scheduler.offload
        real_schedule, real_step = sched.schedule, engine.step

        def schedule():
            chunks = real_schedule()
            now = time.perf_counter()
            for c in chunks:
                if "scheduled" not in self.marks[c.seq.request_id] and not c.seq.request_id.endswith("-t0"):
                    self._step_marks.setdefault("scheduled", now)
                if "scheduled" not in self.marks[c.seq.request_id]:
                    self.marks[c.seq.request_id]["scheduled"] = now
                    self.step_of[c.seq.request_id]["scheduled"] = len(self.steps)
                    # its first chunk took all the prompt it had left, or the step's budget ran out first
                    self.first_chunk_whole[c.seq.request_id] = c.samples
            return chunks

        def step():
            t, ahead, loads = time.perf_counter(), engine.multi_step.ahead is not None, len(sched.loading)
            self._step_marks = {}
            try:
                return real_step()
            finally:
                end = time.perf_counter()
                self.steps.append(end - t)
                m = self._step_marks
                if "scheduled" in m:
                    polled = m.get("polled", m["scheduled"])
                    self.admitting.append((m["scheduled"] - t, polled - m["scheduled"], end - polled))
                kind = "continue" if ahead else "scheduled"
                self.kinds[f"{kind}{'+loading' if loads or sched.loading else ''}"].append(self.steps[-1])

        sched.schedule, engine.step = schedule, step  # type: ignore[method-assign]
        if offload is not None:
            real_start, real_poll = offload.start_load, sched.poll_host_tier

            def start_load(key, pages, slots):
                self.marks[key.request_id].setdefault("load_started", time.perf_counter())
                self.step_of[key.request_id].setdefault("load_started", len(self.steps))
                return real_start(key, pages, slots)

            def poll(read_kv):  # (LOAD_WAY same-step writes a load after the schedule that admitted it)
                before = set(sched.loading) | set(sched.writing)
                out = real_poll(read_kv)
                now = time.perf_counter()
                if "scheduled" in self._step_marks:
                    self._step_marks["polled"] = now
                for seq in before - set(sched.loading) - set(sched.writing):
                    self.marks[seq.request_id].setdefault("written", now)
                    self.step_of[seq.request_id].setdefault("written", len(self.steps))
                return out

            offload.start_load, sched.poll_host_tier = start_load, poll  # type: ignore[method-assign]
        # the engine thread's seconds in each of these calls, all steps (name -> [calls, seconds]; nested calls count
        # in each): which part of an admitting step's host time is which
        self.calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        timed = [(engine, "fetch"), (engine.multi_step, "settle"), (engine.builder, "build"), (sched, "schedule")]
        timed += [
            (sched, n) for n in ("_lookup_hashes", "_host_run", "_reserve", "_name_loaded", "register_full_pages")
        ]
        timed += [(engine.pool, n) for n in ("allocate", "register")]
        if offload is not None:
            timed += [(offload, n) for n in ("match", "start_load", "poll", "flush", "_write", "_commit_puts")]
        for owner, name in timed:
            self._time_calls(owner, name)

    def _time_calls(self, owner, name: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                tally = self.calls[f"{type(owner).__name__}.{name}"]
                tally[0] += 1
                tally[1] += time.perf_counter() - t

        setattr(owner, name, timed)

    def report(self, sent: dict[str, float], first: dict[str, float]) -> dict:
        """p50 ms of each phase over the requests that have both its ends."""
        order = ["sent", "load_started", "written", "scheduled", "first_token"]
        gaps: dict[str, list[float]] = collections.defaultdict(list)
        for rid, t0 in sent.items():
            m = {"sent": t0, **self.marks.get(rid, {}), **({"first_token": first[rid]} if rid in first else {})}
            seen = [k for k in order if k in m]
            for x, y in itertools.pairwise(seen):
                gaps[f"{x}->{y}"].append(m[y] - m[x])

        def p50(xs: list[float]) -> list:  # [count, p50 ms]
            return [len(xs), round(float(np.percentile(xs, 50)) * 1000, 2)]

        out: dict[str, Any] = {k: p50(v) for k, v in gaps.items()}
        out["step_ms_p50_p90_max"] = (
            [round(float(np.percentile(self.steps, q)) * 1000, 2) for q in (50, 90, 100)] if self.steps else []
        )
        for x, y in (("load_started", "written"), ("scheduled", "first_token")):  # engine steps between the two
            between = [m[y] - m[x] for rid, m in self.step_of.items() if rid in sent and x in m and y in m]
            if between:
                out[f"steps_{x}_to_{y}_p50_p90_max"] = [int(np.percentile(between, q)) for q in (50, 90, 100)]
        whole = [w for rid, w in self.first_chunk_whole.items() if rid in sent]
        if whole:  # returning turns whose first chunk took the rest of their prompt, of all
            out["first_chunk_whole"] = [sum(whole), len(whole)]
        out["step_ms_p50_by_kind"] = {k: p50(v) for k, v in self.kinds.items()}
        if self.admitting:  # the steps that admit returning turns: start -> scheduled -> loads written -> end
            parts = np.asarray(self.admitting) * 1000
            out["admitting_steps_schedule_poll_rest_ms_p50"] = [len(parts), *np.round(np.median(parts, 0), 2).tolist()]
        # calls, total ms, mean ms
        out["calls"] = {
            k: [int(n), round(t * 1000, 1), round(t * 1000 / n, 3)] for k, (n, t) in self.calls.items() if n
        }
        return out


COMPILES: list[float] = []  # backend compiles' seconds while conversations run (warm-up should leave none)
_SERVING = [False]


def _count_compile(event: str, seconds: float, **_) -> None:
    if _SERVING[0] and event == "/jax/core/compile/backend_compile_duration":
        COMPILES.append(seconds)


jax.monitoring.register_event_duration_secs_listener(_count_compile)  # type: ignore[arg-type]


def conversations(engine: LLMEngine, a, vocab: int) -> dict:
    """Runs every conversation's turns; returns TTFTs by first/returning turn, throughput and the tier's stats."""
    rng = np.random.default_rng(a.seed)
    COMPILES.clear()
    _SERVING[0] = True
    phases = Phases(engine) if a.phases else None
    sent_at: dict[str, float] = {}  # returning turns' ids -> sent (phases)
    first_at: dict[str, float] = {}

    def words(n: int) -> list[int]:
        return [int(t) for t in rng.integers(100, vocab, size=n)]

    history = [words(a.first_len) for _ in range(a.conversations)]
    # drawn up front: turns end in an order that timing decides, and conversation c's turn t must get the same message
    # in every run (drawn as turns ended, two runs' histories differed, and so did their answers)
    user = [[words(a.user_len) for _ in range(a.turns)] for _ in range(a.conversations)]
    turn = [0] * a.conversations
    queue = collections.deque(range(a.conversations))
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True, detokenize=False)
    inflight: dict[str, tuple[int, float]] = {}  # request id -> (conversation, sent at)
    ttft: dict[str, list[float]] = {"first": [], "returning": []}
    answers: dict[str, list[int]] = {}
    prompt_tokens = output_tokens = 0
    start = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < a.concurrency:
            c = queue.popleft()
            rid = f"c{c}-t{turn[c]}"
            engine.add_request(rid, history[c], params)
            inflight[rid], answers[rid] = (c, time.perf_counter()), []
            if turn[c] > 0:
                sent_at[rid] = inflight[rid][1]
            prompt_tokens += len(history[c])
        for out in engine.step():
            c, sent = inflight[out.request_id]
            got = out.outputs[0].token_ids if out.outputs else []
            if got and not answers[out.request_id]:
                first_at[out.request_id] = time.perf_counter()
                if phases:  # the step that just returned (a mark during step k has index k)
                    phases.step_of[out.request_id]["first_token"] = len(phases.steps) - 1
                ttft["first" if turn[c] == 0 else "returning"].append(first_at[out.request_id] - sent)
            answers[out.request_id] += got
            if out.finished:
                del inflight[out.request_id]
                output_tokens += len(answers[out.request_id])
                history[c] = history[c] + answers[out.request_id] + user[c][turn[c]]
                turn[c] += 1
                if turn[c] < a.turns:
                    queue.append(c)
    wall = time.perf_counter() - start
    _SERVING[0] = False
    s, offload = engine.stats(), engine.scheduler.offload
    timing = offload.timing_summary() if offload is not None else {}
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else float("nan")  # noqa: E731
    return dict(
        ttft_first_p50_ms=pct(ttft["first"], 50),
        ttft_first_p99_ms=pct(ttft["first"], 99),
        ttft_returning_p50_ms=pct(ttft["returning"], 50),
        ttft_returning_p99_ms=pct(ttft["returning"], 99),
        output_tokens_per_s=output_tokens / wall,
        total_tokens_per_s=(prompt_tokens + output_tokens) / wall,
        seconds=wall,
        prompt_tokens=prompt_tokens,
        preemptions=s.preemptions,
        computed_prompt_tokens=prompt_tokens - s.prefix_cache_hit_tokens - s.kv_offload_hit_tokens,
        device_hit_tokens=s.prefix_cache_hit_tokens,
        host_hit_tokens=s.kv_offload_hit_tokens,
        host_queried_tokens=s.kv_offload_queried_tokens,
        bytes_to_host=s.kv_offload_bytes_to_host,
        bytes_to_device=s.kv_offload_bytes_to_device,
        failed_loads=s.kv_offload_failed_loads,
        saved_seconds_estimate=s.kv_offload_saved_seconds,
        timing=timing,
        compiles_while_serving=[len(COMPILES), round(sum(COMPILES), 3)],
        **({"phases": phases.report(sent_at, first_at)} if phases else {}),
        answers=[answers[k] for k in sorted(answers)],
    )


def first_token_seconds(engine: LLMEngine, prompt: list[int], rid: str) -> float:
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def settle(engine: LLMEngine, timeout_s: float = 30.0) -> None:
    """Lets the fillers' copies to the host land first, so that the timed request's load is all that moves."""
    deadline = time.monotonic() + timeout_s
    offload = engine.scheduler.offload
    assert offload is not None, "an engine with a host tier"
    while offload.busy and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.001)


def agreement(answers: list[list[int]], reference: list[list[int]]) -> dict:
    """How many answers equal the reference's, and how far the others go before their first different token."""
    same, prefix = 0, []
    for a, r in zip(answers, reference, strict=True):
        if a == r:
            same += 1
        else:
            prefix.append(next((i for i, (x, y) in enumerate(zip(a, r, strict=False)) if x != y), min(len(a), len(r))))
    return dict(identical=same, of=len(reference), first_difference_p50=float(np.median(prefix)) if prefix else None)


def tier_sample(tier, most: int = 1024) -> dict:
    """Copies of the tier's most recently used pages by hash (break-even's fillers evict them later)."""
    recent = list(tier._slot_of.items())[-most:]
    chunks = tier.read([slot for _, slot in recent])  # (chunk, its copy, row) of each
    return {h: np.asarray(data)[row] for (h, _), (_, data, row) in zip(recent, chunks, strict=True)}


def compare_pages(sample: dict, reference: LLMEngine) -> dict:
    """Tier pages against the pages of the same hash on an engine that evicted nothing: bit-identical ones, and the
    largest difference relative to the page's largest value (rounding: about one ulp of the dtype; a page restored
    with another page's bytes: order 1)."""
    items = [(h, page) for h, page in sample.items() if h in reference.pool._page_of]
    axis = 0 if layout_of(reference.kv.v[0]) == PAGES_INTERLEAVED else 1
    same, worst = 0, 0.0
    for start in range(0, len(items), 64):
        part = items[start : start + 64]
        pages = np.zeros(64, np.int32)  # one compiled shape
        pages[: len(part)] = [reference.pool._page_of[h] for h, _ in part]
        ref = np.asarray(gather_pages(reference.kv, pages, page_axis=axis)).astype(np.float32)
        for r, (_, m) in zip(ref, part, strict=False):
            m = m.astype(np.float32)
            same += bool(np.array_equal(r, m))
            worst = max(worst, float(np.abs(r - m).max() / max(float(np.abs(r).max()), 1e-30)))
    return dict(pages=len(items), bit_identical=same, max_relative_difference=worst)


def break_even(engine: LLMEngine, lengths: list[int], vocab: int, seed: int) -> list[dict]:
    """TTFT of a prefix of each length prefilled, then again after other prompts evicted it from the device (so it
    comes back from the host tier): where copying back starts to pay."""
    rng, rows = np.random.default_rng(seed + 1), []
    pool_tokens = engine.pool.num_pages * engine.config.page_size
    for n in lengths:
        prompt = rng.integers(100, vocab, size=n).tolist()
        cold = first_token_seconds(engine, prompt, f"cold-{n}")
        for k in range(-(-2 * pool_tokens // max(1, engine.max_model_len - 1))):  # flush the device pool
            filler = rng.integers(100, vocab, size=min(pool_tokens, engine.max_model_len - 1)).tolist()
            first_token_seconds(engine, filler, f"fill-{n}-{k}")
        settle(engine)
        hits = engine.stats().kv_offload_hit_tokens
        warm = first_token_seconds(engine, prompt, f"warm-{n}")
        rows.append(
            dict(
                prefix_tokens=n,
                recompute_ms=cold * 1000,
                host_tier_ms=warm * 1000,
                restored_tokens=engine.stats().kv_offload_hit_tokens - hits,
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 elsewhere")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-len", type=int, default=256, help="tokens of each conversation's first message")
    ap.add_argument("--user-len", type=int, default=64, help="tokens of each later user message")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4, help="turns in flight at once")
    ap.add_argument(
        "--pool-ratio", type=float, default=4.0, help="final working set / device KV pool (3-5 in issue 33)"
    )
    ap.add_argument("--tier-ratio", type=float, default=1.5, help="host tier / final working set")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES], help="what K/V pages store (fp8: half)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--smallest-bucket", type=int, default=16)
    ap.add_argument("--break-even", type=int, nargs="*", default=[], help="prefix lengths to time alone")
    ap.add_argument(
        "--decode-steps-with-room",
        type=int,
        default=None,
        help="decode steps a dispatch takes while rows are free (EngineConfig's; default: its own)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run a device pool that evicts nothing, the tier's answers' reference",
    )
    ap.add_argument("--phases", action="store_true", help="where returning turns' TTFT goes, phase by phase")
    ap.add_argument(
        "--also-way",
        action="append",
        default=[],
        choices=host_offload.LOAD_WAYS,
        help="also a tier run whose loads go this way (LOAD_WAY in host_offload; repeatable)",
    )
    ap.add_argument(
        "--also-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also a tier run with this environment variable set (e.g. CAPSTAN_KV_OFFLOAD_RESTORE_HEADROOM=1; "
        "repeatable; NAME=V1,V2: one run each; A=1+B=2: one run with both)",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.dtype = a.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = shape_config(a.shape)
    final_len = a.first_len + (a.turns - 1) * (a.user_len + a.output_len) + a.output_len
    a.max_model_len = max(final_len, *a.break_even, 0) + a.page_size
    working_set = a.conversations * -(-final_len // a.page_size)  # pages
    kv_dtype = cache_dtype(a.kv_cache_dtype, a.dtype)
    page_bytes = KVCache.bytes_per_page(cfg.num_layers, a.page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    need = a.concurrency * -(-a.max_model_len // a.page_size)  # the turns in flight must fit at once
    num_pages = max(int(working_set / a.pool_ratio), need, *[-(-n // a.page_size) + 1 for n in a.break_even])
    tier_gib = a.tier_ratio * working_set * page_bytes / (1 << 30)
    print(
        f"{a.shape} {a.dtype} (K/V pages {kv_dtype.name}) on {jax.devices()[0].device_kind}: {a.conversations} conversations x {a.turns} turns, "
        f"final prompt {final_len} tokens; working set {working_set} pages, device pool {num_pages} pages "
        f"({working_set / num_pages:.1f}x), host tier {tier_gib:.3f} GiB"
    )
    model = random_model(cfg, a.dtype)
    results: dict[str, Any] = {}
    default_way = host_offload.LOAD_WAY
    # (name, device pool pages, tier GiB, the tier's LOAD_WAY, environment variables set while its engine is made)
    runs: list[tuple[str, int, float, str, dict[str, str]]] = [
        ("recompute", num_pages, 0.0, default_way, {}),
        ("host_tier", num_pages, tier_gib, default_way, {}),
    ]
    runs += [(f"host_tier_{way}", num_pages, tier_gib, way, {}) for way in a.also_way]
    for setting in a.also_setting:
        if "+" in setting:  # several variables for one run ("A=1+B=2"); CAPSTAN_KV_OFFLOAD_LOAD_WAY picks its way
            env = dict(pair.partition("=")[::2] for pair in setting.split("+"))
            short = "+".join(f"{k.removeprefix('CAPSTAN_KV_OFFLOAD_').lower()}={v}" for k, v in env.items())
            way = env.pop("CAPSTAN_KV_OFFLOAD_LOAD_WAY", default_way)
            runs.append((f"host_tier_{short}", num_pages, tier_gib, way, env))
            continue
        key, _, values = setting.partition("=")
        short = key.removeprefix("CAPSTAN_KV_OFFLOAD_").lower()
        runs += [(f"host_tier_{short}={v}", num_pages, tier_gib, default_way, {key: v}) for v in values.split(",")]
    if a.reference:
        runs.append(("cached", working_set + need, 0.0, default_way, {}))
    sample = {}
    for name, pages, gib, way, env in runs:
        host_offload.LOAD_WAY = way  # (both read when the tier is made)
        with mock.patch.dict(os.environ, env):
            engine = engine_for(model, a, pages, gib)
        results[name] = conversations(engine, a, cfg.vocab_size)
        x = results[name]  # (printed as each run ends: a call cut short still shows the runs it finished)
        print(
            f"{name} ran: returning TTFT p50 {x['ttft_returning_p50_ms']:.1f} p99 {x['ttft_returning_p99_ms']:.1f} ms, "
            f"{x['total_tokens_per_s']:.0f} tokens/s, compiles while serving {x['compiles_while_serving']}",
            flush=True,
        )
        if name == "host_tier":
            settle(engine)
            assert engine.scheduler.offload is not None  # the host_tier run's engine has one
            sample = tier_sample(engine.scheduler.offload.tier)
            if a.break_even:
                results["break_even"] = break_even(engine, a.break_even, cfg.vocab_size, a.seed)
        if name == "cached":
            results["tier_pages_vs_cached"] = compare_pages(sample, engine)
            print("tier pages against cached", json.dumps(results["tier_pages_vs_cached"]))
        del engine
    answers = {name: results[name].pop("answers") for name, *_ in runs}
    same = answers["recompute"] == answers["host_tier"]
    for name, *_ in runs:
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results[name].items()}))
    if a.reference:  # the tier against K/V computed the same way; recompute against both
        results["answers"] = {
            "host_tier_vs_cached": agreement(answers["host_tier"], answers["cached"]),
            "recompute_vs_cached": agreement(answers["recompute"], answers["cached"]),
            "host_tier_vs_recompute": agreement(answers["host_tier"], answers["recompute"]),
            **{
                f"{n}_vs_cached": agreement(answers[n], answers["cached"])
                for n in answers
                if n.startswith("host_tier_")
            },
        }
        print("greedy answers", json.dumps(results["answers"]))
    r = results["recompute"]
    for name in [n for n, *_ in runs if n.startswith("host_tier")]:
        h = results[name]
        print(
            f"{name}: returning turns' TTFT p50 {r['ttft_returning_p50_ms']:.1f} -> {h['ttft_returning_p50_ms']:.1f} ms "
            f"({r['ttft_returning_p50_ms'] / h['ttft_returning_p50_ms']:.2f}x lower), p99 "
            f"{r['ttft_returning_p99_ms']:.1f} -> {h['ttft_returning_p99_ms']:.1f} ms; total tokens/s "
            f"{r['total_tokens_per_s']:.0f} -> {h['total_tokens_per_s']:.0f}; greedy answers identical: "
            f"{answers['recompute'] == answers[name]}"
        )
    for row in results.get("break_even", []):
        print("break-even", json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(args=vars(a), identical=same, **results), indent=1))


if __name__ == "__main__":
    main()
