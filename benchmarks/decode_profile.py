"""Where a decode step's time goes, on a named shape with random weights (GPU diagnostic).

python benchmarks/decode_profile.py --shape llama-3.2-1b --rows 1 256
python benchmarks/decode_profile.py --shape llama-3-8b --quantization fp8 --rows 1 --trace /tmp/fp8trace
python benchmarks/decode_profile.py --shape llama-3-8b --kv-cache-dtype fp8 --rows 1 64 --context 4096 --quick
Times, per row count: one model forward with the decode kernel and with the reference attention, the sampler,
and one step of the multi-step decode."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402
from timing import median_ms as timed  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.engine.multi_step import decode_steps_fn  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402
from capstan.runtime.sampling.programs import GREEDY_SCAN  # noqa: E402
from capstan.runtime.sampling.sampler import sample  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402


def leave_one_out(results: dict, step, model, kv, xd) -> None:
    """The forward with the decode kernel, and (METHOD.md) the same without attention, the K/V writes, or both."""
    results["forward_decode_kernel_ms"] = timed(step, model, kv, xd)
    import capstan.runtime.attention as layers  # write_and_attend looks both up here when traced

    real_attend, real_write = layers.attend, layers.write_kv
    for name, attend, write in (
        ("no_attention", lambda q, *a, **k: q, real_write),
        ("no_kv_write", real_attend, lambda cache, *a: cache),
        ("no_attention_no_kv_write", lambda q, *a, **k: q, lambda cache, *a: cache),
    ):
        layers.attend, layers.write_kv = attend, write
        variant = jax.jit(lambda m, kv, x: m(x.tokens, x.meta, kv)[0].array)
        results[f"forward_{name}_ms"] = timed(variant, model, kv, xd)
    layers.attend, layers.write_kv = real_attend, real_write


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--trace", help="also write a Perfetto trace of one multi-step dispatch per row count here")
    ap.add_argument("--quantization", choices=["fp8", "int8", "q8_0"], default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="what K/V pages store: auto (bf16), bfloat16, fp8")
    ap.add_argument("--quick", action="store_true", help="time the multi-step decode only (flag comparisons)")
    ap.add_argument("--page-size", type=int, default=EngineConfig.page_size, help="tokens per KV page")
    a = ap.parse_args()
    cfg = shape_config(a.shape)
    model = random_model(cfg, "bfloat16", quantization=a.quantization)

    for rows in a.rows:
        engine = LLMEngine(
            EngineConfig(
                model=str(DEFAULT_MODEL),
                dtype="bfloat16",
                max_model_len=a.context + 64,
                max_num_seqs=rows,
                max_num_batched_tokens=max(rows, 512),
                decode_steps=1,
                enable_prefix_caching=False,
                warmup=False,
                kv_cache_dtype=a.kv_cache_dtype,
                page_size=a.page_size,
                async_scheduling=False,  # the step below is built from the scheduler's chunks: no token left unread
            ),
            model=model,
        )
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0, detokenize=False)
        for r in range(rows):
            engine.add_request(f"p{r}", rng.integers(0, cfg.vocab_size, a.context).tolist(), params)
        while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
            engine.step()  # prefill everything: from here on every sequence decodes
        chunks = engine.scheduler.schedule()
        packed = engine.builder.build(chunks, bucket=rows)
        x = packed.unpack()
        step = jax.jit(lambda m, kv, x: m(x.tokens, x.meta, kv)[0].array)
        decode_meta = x.meta.__class__(**{**x.meta.__dict__, "decode": True})
        xd = x.__class__(**{**x.__dict__, "meta": decode_meta})
        logits = jnp.zeros((rows, cfg.vocab_size), jnp.float32)
        results = (
            {}
            if a.quick
            else {
                "forward_reference_ms": timed(step, model, engine.kv, x),
                "sampler_ms": timed(jax.jit(sample), logits, x.sampling),
            }
        )
        if not a.quick:
            leave_one_out(results, step, model, engine.kv, xd)
        for c in chunks:
            engine.scheduler.reserve_ahead(c.seq, 9)
        active = jnp.full((rows,), 8, jnp.int32)
        holder = [engine.kv]

        def multi(_, engine=engine, holder=holder, packed=packed, active=active, rows=rows, chunks=chunks):
            holder[0], out, _ = decode_steps_fn(
                model,
                holder[0],
                packed,
                active,
                np.int32(0),
                np.zeros((8, rows), np.int32),
                engine.multi_step._block_tables(chunks, rows),
                None,  # a greedy scan carries no penalty counts
                num_steps=8,
                branches=GREEDY_SCAN,
            )  # the cache is donated
            return out.tokens

        results["multi_step_ms_per_step"] = timed(multi, None, repeats=5) / 8
        if a.trace:  # kernel by kernel: summarise with benchmarks/trace_summary.py
            with jax.profiler.trace(f"{a.trace}/rows{rows}", create_perfetto_trace=True):
                jax.block_until_ready(multi(None))
        print(
            f"rows={rows} context={a.context} kv={a.kv_cache_dtype} page={a.page_size} "
            + " ".join(f"{k}={v:.3f}" for k, v in results.items()),
            flush=True,
        )
        del engine


if __name__ == "__main__":
    main()
