"""How many sequences of a long context the KV pages hold at once, and the throughput there: bf16 against FP8 pages.

python benchmarks/kv_capacity.py --shape llama-3-8b --context 4096 --kv-cache-dtypes auto fp8
For each --kv-cache-dtype, one after the other on the same random weights: the engine sizes its pages from
--kv-memory-fraction of the device memory left free (on CPU, --cpu-kv-mib); capacity is those pages over the pages
one full-context sequence takes. It then runs capacity + --extra requests of context - output-len prompt tokens and
output-len outputs (greedy, random tokens) and reports the most sequences that decoded in one step (the
concurrency reached), preemptions, and output tokens/s; --json writes the figures."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL, KV_CACHE_DTYPES, EngineConfig  # noqa: E402
from capstan.runtime.engine import engine as engine_module  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402


def bytes_in_use() -> int:
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use", 0)


def measure(model, cfg, a, kv_cache_dtype: str, dtype: str) -> dict:
    in_use = bytes_in_use()
    engine = LLMEngine(
        EngineConfig(
            model=str(DEFAULT_MODEL),
            dtype=dtype,
            max_model_len=a.context,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            smallest_token_bucket=a.smallest_bucket,
            page_size=a.page_size,
            kv_memory_fraction=a.kv_memory_fraction,
            enable_prefix_caching=False,
            kv_cache_dtype=kv_cache_dtype,
        ),
        model=model,
    )
    engine.warmup()
    pages = engine.config.num_pages
    per_sequence = -(-a.context // a.page_size)
    capacity = pages // per_sequence
    if capacity == 0:
        raise SystemExit(
            f"{kv_cache_dtype}: {pages} pages hold no sequence of {a.context} tokens ({per_sequence} pages)"
        )
    requests = min(a.max_num_seqs, capacity + a.extra)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, a.context - a.output_len).tolist() for _ in range(requests)]
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, params)
    start, out_tokens, peak_decoding, steps = time.perf_counter(), 0, 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        out_tokens += sum(len(o.token_ids) for r in outs for o in r.outputs)
        peak_decoding = max(peak_decoding, sum(not s.in_prefill for s in engine.scheduler.running))
    seconds = time.perf_counter() - start
    figures = {
        "kv_cache_dtype": kv_cache_dtype,
        "kv_dtype": str(engine.kv.k[0].dtype),
        "kv_pages": pages,
        "kv_gib": sum(x.nbytes for x in (*engine.kv.k, *engine.kv.v)) / (1 << 30),
        "bytes_in_use_before_gib": in_use / (1 << 30),
        "pages_per_sequence": per_sequence,
        "capacity_sequences": capacity,
        "rows_bound": capacity > a.max_num_seqs,  # --max-num-seqs rows a step: raise it to see the whole capacity
        "requests": requests,
        "peak_decoding_sequences": peak_decoding,
        "preemptions": engine.stats().preemptions,
        "seconds": seconds,
        "steps": steps,
        "output_tokens_per_s": out_tokens / seconds,
        "compile_s": engine.compile_seconds,
    }
    engine.pool.check_all_free()
    del engine
    gc.collect()  # its pages go before the next engine measures the memory left
    return figures


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=4096, help="tokens a sequence reaches (prompt + output)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"], choices=KV_CACHE_DTYPES)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--smallest-bucket", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-memory-fraction", type=float, default=EngineConfig.kv_memory_fraction)
    ap.add_argument("--extra", type=int, default=8, help="requests beyond the capacity (they wait for pages)")
    ap.add_argument("--cpu-kv-mib", type=float, help="the KV budget on CPU (no memory stats there)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    if a.cpu_kv_mib:
        engine_module.CPU_KV_BYTES = int(a.cpu_kv_mib * (1 << 20))
    dtype = a.dtype if a.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = shape_config(a.shape)
    model = random_model(cfg, dtype)
    jax.block_until_ready(model)
    print(f"{jax.devices()[0].device_kind}, {a.shape} {dtype}, context {a.context}", flush=True)
    results = []
    for kv in a.kv_cache_dtypes:
        figures = measure(model, cfg, a, kv, dtype)
        results.append(figures)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()), flush=True)
    if len(results) > 1:
        base = results[0]
        for r in results[1:]:
            print(
                f"{r['kv_cache_dtype']} / {base['kv_cache_dtype']}: capacity "
                f"{r['capacity_sequences'] / max(1, base['capacity_sequences']):.2f}x, concurrency reached "
                f"{r['peak_decoding_sequences'] / max(1, base['peak_decoding_sequences']):.2f}x, output tokens/s "
                f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x",
                flush=True,
            )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
