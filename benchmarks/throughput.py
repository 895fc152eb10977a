"""Offline throughput of Capstan's engine on a named shape with random weights (no download).

python benchmarks/throughput.py --shape tiny --requests 64 --prompt-len 64 --output-len 64
prints output tokens/s, prefill tokens/s, compile time and peak KV pages; --json writes them too.
--processes N with --tensor-parallel-size N: the engine in N processes of one GPU each, in lockstep
(engine/lockstep.py, the multi-host engine), instead of one process driving the N GPUs."""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
import json
import pstats
import sys
import time
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import numpy as np
from haliax import NamedArray

sys.path.insert(0, str(Path(__file__).parent))
from processes import JOINED, join, run_joined  # noqa: E402
from shapes import shape_config  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.engine.lockstep import LockstepEngine  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402
from capstan.runtime.parallel.tensor_parallel import TensorParallel  # noqa: E402
from capstan.runtime.sampling.grammar import StructuredOutput  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402
from capstan.runtime.sampling_keys import SamplingDefaults  # noqa: E402

UNBOUNDED_SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 100000}  # cannot end early


def peaked(model, gain: float, vocab_size: int):
    """The model with its LM head's output rows of 512 random tokens scaled by gain (e.g. 8): it then picks among them
    with clear margins, as a trained model's confident tokens are. Random weights alone give nearly flat rows, where
    top-p 0.9 keeps most of the vocabulary (the sampler's hardest case, and bf16 rounding flips near-ties)."""
    ids = np.random.default_rng(2).choice(vocab_size, 512, replace=False)
    assert isinstance(model.lm_head, NamedArray), "random weights: a dense LM head"
    head = model.lm_head.array.at[ids].multiply(gain)
    return eqx.tree_at(lambda m: m.lm_head, model, hax.named(head, model.lm_head.axes))


def mixed_workload(rng, vocab_size: int, a) -> tuple[list, list]:
    """Variable lengths and a mix of greedy, top-p and top-k sampling (seeded), as real traffic has."""
    prompts, params = [], []
    kinds: list[SamplingDefaults] = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 50, "min_p": 0.05},
    ]
    for i in range(a.requests):
        prompts.append(rng.integers(0, vocab_size, int(rng.integers(a.prompt_len // 4, 2 * a.prompt_len))).tolist())
        kind: SamplingDefaults = {"temperature": 0.0} if a.all_greedy else kinds[i % 3]
        params.append(
            dataclasses.replace(
                SamplingParams(**kind, **a.sampling),
                max_tokens=int(rng.integers(max(1, a.output_len // 8), 2 * a.output_len)),
                ignore_eos=True,
                detokenize=False,
                seed=i,
            )
        )
    return prompts, params


class Timeline:
    """Splits each engine step's wall time (benchmark-only wrappers around the engine's own calls): building the
    inputs, the jitted call until it returns, waiting for its results, and the host's work on them (the rest); a
    speculative step's draft-model dispatch (its proposals stay on the device) is a part of its own; each kind's
    wall time over the output tokens its steps yielded (all rows together) is its ms a token. A decode dispatch
    queued ahead is called on the engine's dispatch thread: its call time lands in the step it ends in, overlapping
    that step's other parts, so only the steps' wall times add up."""

    PARTS = ("build", "draft", "call", "fetch")

    def __init__(self, engine: LLMEngine):
        import capstan.runtime.engine.engine as engine_mod
        import capstan.runtime.engine.multi_step as multi_mod
        import capstan.runtime.speculative.speculator as spec_mod

        self.sums: dict[str, dict[str, float]] = {}  # kind -> {part: seconds, "steps": n, "wall": seconds}
        self.current: dict | None = None
        # (owner, attribute, part, the step kind a call of it makes)
        for owner, name, part, kind in (
            (engine, "_build", "build", None),
            (engine, "fetch", "fetch", None),
            (engine_mod, "step_fn", "call", None),
            (multi_mod, "decode_steps_fn", "call", "multi-step"),
            (spec_mod, "verify_fn", "call", "verify"),
        ):
            setattr(owner, name, self._timed(getattr(owner, name), part, kind))
        if engine.speculator is not None and engine.speculator.draft is not None:  # its dispatch
            draft = engine.speculator.draft
            draft.propose = self._timed(draft.propose, "draft", None)  # type: ignore[method-assign]  # timed in place

    def _timed(self, fn, part, kind):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.current[part] = self.current.get(part, 0.0) + time.perf_counter() - t0
                    if kind:
                        self.current["kind"] = kind

        return wrapper

    def step(self, engine: LLMEngine):
        self.current = {}
        t0 = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t0
        kind = self.current.get("kind", "single")
        agg = self.sums.setdefault(kind, {"steps": 0, "wall": 0.0, "tokens": 0})
        agg["steps"] += 1
        agg["wall"] += wall
        agg["tokens"] += sum(len(o.token_ids) for r in outs for o in r.outputs)  # what the step's kind yields
        for part, v in self.current.items():
            if part in self.PARTS:
                agg[part] = agg.get(part, 0.0) + v
        self.current = None
        return outs

    def report(self) -> dict:
        out = {}
        for kind, agg in self.sums.items():
            n = agg["steps"]
            parts = {p: agg.get(p, 0.0) for p in self.PARTS if p in agg or p != "draft"}
            parts["host_after"] = agg["wall"] - sum(parts.values())
            per_token = f", {1000 * agg['wall'] / agg['tokens']:.3f} ms a token" if agg["tokens"] else ""
            out[kind] = f"{n} steps, {1000 * agg['wall'] / n:.2f} ms each{per_token}: " + ", ".join(
                f"{p} {1000 * v / n:.2f}" for p, v in parts.items()
            )
        return out


BACKEND_COMPILES = {"n": 0, "s": 0.0}  # XLA compiles so far: one in a timed run is a shape the warm-up missed


def _count_compile(event: str, duration_secs: float, **_: str | int) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        BACKEND_COMPILES["n"] += 1
        BACKEND_COMPILES["s"] += duration_secs


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def run(
    engine: LLMEngine,
    prompts,
    params,
    timeline: Timeline | None = None,
    trace: str | None = None,
    loras=None,
    digest: bool = False,
    trace_step: int | None = None,
    host_profile: int = 0,
) -> dict:
    """loras: a LoRARequest (or None) per prompt (benchmarks/lora.py); digest: also `tokens_digest`, a hash of each
    request's generated ids, request by request (host work in the timed loop, so only when asked); trace_step: the
    engine step traced (default: the third of the decode phase); host_profile: the prefill phase's steps run under
    cProfile, its top functions (by own time, then cumulative) printed to stderr (the profiler slows the host)."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    rids = [f"b{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    generated: dict[str, list[int]] = {rid: [] for rid in rids}
    for i, (rid, p, sp) in enumerate(zip(rids, prompts, per_prompt, strict=True)):
        engine.add_request(rid, p, sp, lora_request=loras[i] if loras else None)
    compiles = dict(BACKEND_COMPILES)
    start, first_decode, peak_pages, out_tokens, steps = time.perf_counter(), None, 0, 0, 0
    traced = -1 if trace_step is None else trace_step
    ids = hashlib.sha256()
    profiler = cProfile.Profile()
    while engine.has_unfinished():
        tracing = bool(trace) and steps == traced
        if trace and tracing:  # one step's kernels, for benchmarks/trace_summary.py
            jax.profiler.start_trace(trace, create_perfetto_trace=True)
        profiling = host_profile and first_decode is None
        if profiling:
            profiler.enable()
        outs = timeline.step(engine) if timeline else engine.step()
        if profiling:
            profiler.disable()
        if tracing:
            jax.profiler.stop_trace()
        steps += 1
        peak_pages = max(peak_pages, engine.pool.num_used)
        out_tokens += sum(len(o.token_ids) for r in outs for o in r.outputs)
        for r in outs if digest else ():
            generated[r.request_id].extend(t for o in r.outputs for t in o.token_ids)
        if (
            first_decode is None
            and not engine.scheduler.waiting
            and all(not s.in_prefill for s in engine.scheduler.running)
        ):
            first_decode = time.perf_counter()
            if trace_step is None:
                traced = steps + 2  # the third step of the decode phase: a run's dispatch queued ahead
    end = time.perf_counter()
    for order in ("tottime", "cumulative") if host_profile else ():
        print(f"--- the prefill phase's host, by {order}", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats(order).print_stats(host_profile)
    for rid in rids if digest else ():  # in request order: the same whatever order steps finished them in
        ids.update(np.asarray(generated[rid], np.int64).tobytes())
    prefill_s = (first_decode or end) - start
    return {
        "seconds": end - start,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / (end - start),
        "prefill_tokens_per_s": sum(map(len, prompts)) / prefill_s,
        "prefill_phase_s": prefill_s,
        "decode_phase_s": end - start - prefill_s,
        "steps": steps,
        "peak_kv_pages": peak_pages,
        "compiles_in_run": BACKEND_COMPILES["n"] - compiles["n"],
        "compile_s_in_run": BACKEND_COMPILES["s"] - compiles["s"],
        **({"tokens_digest": ids.hexdigest()[:12]} if digest else {}),
        **({f"timeline_{k}": v for k, v in timeline.report().items()} if timeline else {}),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--smallest-bucket", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps)
    ap.add_argument(
        "--decode-steps-with-room",
        type=int,
        default=None,
        help="decode steps a dispatch takes while rows are free (default: EngineConfig's)",
    )
    ap.add_argument("--single-stream-tokens", type=int, default=0, help="also time one stream's decode")
    ap.add_argument(
        "--single-stream-top-p", type=float, default=0.0, help="and one stream sampled at temperature 1 with this top-p"
    )
    ap.add_argument(
        "--workload",
        choices=["fixed", "mixed"],
        default="fixed",
        help="fixed: every request prompt-len in, output-len out, greedy; mixed: lengths uniform in "
        "[prompt-len/4, 2 prompt-len] and [output-len/8, 2 output-len], a third greedy, a third "
        "temperature 0.8 + top-p 0.9, a third temperature 1.0 + top-k 50 + min-p 0.05",
    )
    ap.add_argument("--all-greedy", action="store_true", help="the mixed workload's lengths, every request greedy")
    ap.add_argument(
        "--peaked",
        type=float,
        default=0.0,
        metavar="GAIN",
        help="scale the LM head's rows of 512 random tokens by GAIN (e.g. 8): peaked rows, as a trained model gives, "
        "instead of random weights' flat ones (top-p then keeps a few tokens, not most of the vocabulary)",
    )
    ap.add_argument(
        "--sampling",
        type=json.loads,
        default={},
        help='SamplingParams fields every mixed request also sets, e.g. \'{"repetition_penalty": 1.1, '
        '"dry_multiplier": 0.8}\' (penalties, DRY)',
    )
    ap.add_argument(
        "--constrained-fraction",
        type=float,
        default=0.0,
        help="this share of the requests follows a JSON schema (structured outputs); the rest is free",
    )
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="devices to split the model over")
    ap.add_argument(
        "--gathered-greedy",
        action="store_true",
        help="split, a plain greedy decode scan gathers the logits and samples them whole (as before vocab_greedy.py)",
    )
    ap.add_argument(
        "--unplaced-dispatch-args",
        action="store_true",
        help="a decode dispatch's small host arguments go to its jitted call as numpy arrays (as before "
        "MultiStepDecoder._placed), put on the device by the dispatch thread",
    )
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="steps with prompt tokens queued while the host reads the step before (EngineConfig.async_scheduling; "
        "default: on GPUs and TPUs, off on CPU)",
    )
    ap.add_argument(
        "--fetch-all",
        action="store_true",
        help="a single step's every output comes to the host, logprobs no row asked for too (as before "
        "LLMEngine._fetch_step)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bfloat16", "fp8", "fp8_e4m3"],
        help="what K/V pages store (auto: the model's dtype; fp8: e4m3, twice the pages)",
    )
    ap.add_argument(
        "--quantization",
        choices=["fp8", "int8", "q8_0"],
        default=None,
        help="linear weights quantized at load (the random weights, per output channel; q8_0: in GGUF "
        "Q8_0's blocks of 32, as a Q8_0 file is served)",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="also split each step's time into building, the jitted call, waiting, and the host's work",
    )
    ap.add_argument("--trace", help="write a Perfetto trace of one decode-phase engine step here")
    ap.add_argument("--trace-step", type=int, default=None, help="trace this engine step instead (e.g. a prefill one)")
    ap.add_argument(
        "--host-profile", type=int, default=0, metavar="N", help="the prefill phase under cProfile: its top N functions"
    )
    ap.add_argument(
        "--digest", action="store_true", help="also a hash of every request's generated ids (same tokens, same hash)"
    )
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages (default: the engine's sizing)")
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="prefix caching on (off by default: random prompts share nothing); a preempted sequence's full pages "
        "then stay cached until evicted",
    )
    ap.add_argument(
        "--kv-offloading-size",
        type=float,
        default=0.0,
        help="GiB of host memory for evicted prefix-cache pages (implies --prefix-caching): a preempted sequence's "
        "evicted pages come back from there instead of being recomputed (issue 33)",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        help="N > 1: the engine in N processes of one GPU each, in lockstep (one process drives every GPU otherwise)",
    )
    ap.add_argument(JOINED, action="store_true", help=argparse.SUPPRESS)  # a process run_joined started
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    if a.processes > 1 and not a.joined:
        if a.tensor_parallel_size != a.processes:
            raise SystemExit(f"--processes {a.processes} needs --tensor-parallel-size {a.processes} (a GPU each)")
        sys.exit(run_joined(a.processes, [__file__, *(sys.argv[1:] if argv is None else argv)]))
    if a.joined:
        join()
    leader = jax.process_index() == 0
    if a.gathered_greedy:  # the A/B of parallel/vocab_greedy.py: no batch counts as plain greedy for the split pick
        import capstan.runtime.engine.multi_step as multi_step

        multi_step.is_plain_greedy = lambda branches: False
    if a.fetch_all:  # the A/B of LLMEngine._fetch_step
        LLMEngine._fetch_step = lambda self, out, chunks: self.fetch(out)  # type: ignore[method-assign]
    if a.unplaced_dispatch_args:  # the A/B of MultiStepDecoder._placed
        from capstan.runtime.engine.multi_step import MultiStepDecoder

        MultiStepDecoder._placed = lambda self, *arrays: list(arrays)  # type: ignore[method-assign]
    dtype = a.dtype if a.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = shape_config(a.shape)
    t0 = time.perf_counter()
    # under tensor parallelism made in parts on the mesh the engine uses (a 70B shape fits no one device)
    split = TensorParallel.create(a.tensor_parallel_size, cfg).checkpoint_sharding
    model = random_model(cfg, dtype, quantization=a.quantization, split=split)
    if a.peaked:
        model = peaked(model, a.peaked, cfg.vocab_size)
    jax.block_until_ready(model)
    load_s = time.perf_counter() - t0
    mixed = a.workload == "mixed"
    max_len = (2 if mixed else 1) * (a.prompt_len + max(a.output_len, a.single_stream_tokens)) + 1

    def engine_for(max_num_seqs: int, max_tokens: int, pool: bool = True) -> LLMEngine:
        """pool: the batch's KV flags (--num-pages, --kv-offloading-size); the one-stream engine sizes its own."""
        e = (LockstepEngine if a.joined else LLMEngine)(
            EngineConfig(
                model=str(DEFAULT_MODEL),
                dtype=dtype,
                max_model_len=max_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_tokens,
                page_size=a.page_size,
                smallest_token_bucket=a.smallest_bucket,
                decode_steps=a.decode_steps,
                decode_steps_with_room=a.decode_steps_with_room,
                async_scheduling=a.async_scheduling,
                num_pages=a.num_pages if pool else None,
                enable_prefix_caching=a.prefix_caching or a.kv_offloading_size > 0,
                kv_offloading_size=a.kv_offloading_size if pool else 0.0,
                tensor_parallel_size=a.tensor_parallel_size,
                kv_cache_dtype=a.kv_cache_dtype,
            ),
            model=model,
        )
        e.warmup()
        return e

    engine = engine_for(a.max_num_seqs, a.max_num_batched_tokens)
    if not leader:  # a follower takes the leader's steps: its warm and timed runs, then its one stream's
        assert isinstance(engine, LockstepEngine)
        engine.follow()
        if a.single_stream_tokens:
            del engine
            one_row = engine_for(1, max(a.prompt_len, a.smallest_bucket), pool=False)
            assert isinstance(one_row, LockstepEngine)
            one_row.follow()
        return {}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.requests)]
    fixed = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    params: SamplingParams | list[SamplingParams] = fixed
    if mixed:
        if a.constrained_fraction:
            raise SystemExit("--constrained-fraction applies to the fixed workload")
        prompts, params = mixed_workload(rng, cfg.vocab_size, a)
    if a.constrained_fraction:
        # an array of strings that never has to end: every constrained request runs to output_len like the rest
        constrained = dataclasses.replace(fixed, structured=StructuredOutput("json", UNBOUNDED_SCHEMA))
        cut = int(round(a.constrained_fraction * a.requests))
        params = [constrained] * cut + [fixed] * (a.requests - cut)
    warm_rng = np.random.default_rng(1)  # not the run's prompts, nor its generator: no cache hits, same prompts
    warm = [warm_rng.integers(0, cfg.vocab_size, a.prompt_len).tolist() for _ in range(8)]
    run(engine, warm, SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    before = engine.stats()
    print("--- the timed run (JAX_LOG_COMPILES=1: compiles after this line are in it)", file=sys.stderr, flush=True)
    figures = {
        "shape": a.shape,
        "dtype": dtype,
        "quantization": a.quantization or "none",
        "peaked": a.peaked,
        "device": str(jax.devices()[0].device_kind),
        "tensor_parallel_size": a.tensor_parallel_size,
        "processes": jax.process_count(),
        "kv_cache_dtype": a.kv_cache_dtype,
        "kv_pages": engine.config.num_pages,
        "requests": a.requests,
        "prompt_len": a.prompt_len,
        "output_len": a.output_len,
        "weights_init_s": load_s,
        "compile_s": engine.compile_seconds,
        **run(
            engine,
            prompts,
            params,
            Timeline(engine) if a.timeline else None,
            a.trace,
            digest=a.digest,
            trace_step=a.trace_step,
            host_profile=a.host_profile,
        ),
    }
    after = engine.stats()
    if a.joined:
        assert isinstance(engine, LockstepEngine)
        engine.stop_followers()
    if a.prefix_caching or a.kv_offloading_size > 0 or a.num_pages:  # what the pool's pressure did
        figures["preemptions"] = after.preemptions - before.preemptions
        figures["device_hit_tokens"] = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        figures["host_hit_tokens"] = after.kv_offload_hit_tokens - before.kv_offload_hit_tokens
        figures["bytes_to_host"] = after.kv_offload_bytes_to_host - before.kv_offload_bytes_to_host
        figures["bytes_to_device"] = after.kv_offload_bytes_to_device - before.kv_offload_bytes_to_device
    if a.single_stream_tokens:
        one = SamplingParams(max_tokens=a.single_stream_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
        del engine  # its KV pool; one stream gets an engine of one row so it pays for no padding rows
        single = engine_for(1, max(a.prompt_len, a.smallest_bucket), pool=False)
        run(single, prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
        streams = [rng.integers(0, cfg.vocab_size, a.prompt_len).tolist() for _ in range(3)]
        ways = {"single_stream": one}
        if a.single_stream_top_p:  # issue 64: one stream sampled, as users mostly ask (seeded: the same draws a run)
            ways["single_stream_sampled"] = dataclasses.replace(
                one, temperature=1.0, top_p=a.single_stream_top_p, seed=0
            )
        for name, sp in ways.items():
            runs = sorted(1000 * run(single, [p], sp)["seconds"] / a.single_stream_tokens for p in streams)
            figures[f"{name}_ms_per_token"] = runs[1]  # the median of three streams
            figures[f"{name}_ms_per_token_min_max"] = f"{runs[0]:.3f}..{runs[2]:.3f}"
        if a.joined:
            assert isinstance(single, LockstepEngine)
            single.stop_followers()
    for k, v in figures.items():
        print(f"{k:>28}: {v:.4g}" if isinstance(v, float) else f"{k:>28}: {v}")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
