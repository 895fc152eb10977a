"""Multi-LoRA serving against the base model, offline, in one process (issue 32's targets on the H100: >= 0.8x the
base's output tokens/s for 256 requests spread over 8 rank-16 adapters on all seven projections, and one stream with
an adapter within 15% of one without).

Random weights of a named shape, and random PEFT adapters written to a temporary folder and loaded as a user's are.
Runs, each on an engine of its own with the same KV pages: the base model (no --enable-lora); the LoRA engine with
every request on an adapter (request i on adapter i % adapters); the LoRA engine with base requests only (what
enabling LoRA costs rows without one); then one stream of each kind.

python benchmarks/lora.py --shape tiny --requests 16 --prompt-len 16 --output-len 16 --single-stream-tokens 16  # CPU
bash benchmarks/gpu_suite.sh lora                                                                       # H100
CAPSTAN_LORA_GATHER_MAX_TOKENS=0 python benchmarks/lora.py --no-batch   # one stream, every slot's rank space
bash benchmarks/gpu_suite.sh loragather   # one stream by each way of models/lora.py, same call
bash benchmarks/gpu_suite.sh loratrace    # one stream's kernels with an adapter and without"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402
from throughput import run  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.lora.request import LoRARequest  # noqa: E402
from capstan.runtime.models import lora as lora_layers  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(folder: Path, cfg, count: int, rank: int) -> list[LoRARequest]:
    """count random PEFT adapters of this rank on every projection (small B: the activations stay in range)."""
    shapes, loras = cfg.linear_shapes(), []
    for k in range(count):
        rng, tensors = np.random.default_rng(k), {}
        for layer in range(cfg.num_layers):
            for m in MODULES:
                fan_in, fan_out = shapes[m]
                part = "self_attn" if m in MODULES[:4] else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{m}"
                tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / math.sqrt(fan_in)).astype(
                    np.float32
                )
                tensors[f"{prefix}.lora_B.weight"] = (0.02 * rng.standard_normal((fan_out, rank))).astype(np.float32)
        out = folder / f"adapter{k}"
        out.mkdir()
        save_file(tensors, str(out / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
        (out / "adapter_config.json").write_text(json.dumps(config))
        loras.append(LoRARequest(f"adapter{k}", k + 1, str(out)))
    return loras


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=None, help="device slots (default: --adapters; fewer swap)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--smallest-bucket", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps)
    ap.add_argument("--single-stream-tokens", type=int, default=256, help="0: no one-stream runs")
    ap.add_argument("--batch", action=argparse.BooleanOptionalAction, default=True, help="the 256-request runs")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--trace", help="also a Perfetto trace of one stream of 32 tokens per kind here (DIR/base, DIR/lora)"
    )
    a = ap.parse_args(argv)
    dtype = a.dtype if a.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = shape_config(a.shape)
    model = random_model(cfg, dtype)
    jax.block_until_ready(model)
    folder = Path(tempfile.mkdtemp(prefix="capstan-lora-"))
    t0 = time.perf_counter()
    loras = write_adapters(folder, cfg, a.adapters, a.rank)
    print(f"{a.adapters} adapters of rank {a.rank} written in {time.perf_counter() - t0:.1f} s")
    max_len = a.prompt_len + max(a.output_len, a.single_stream_tokens) + 1
    pages = a.max_num_seqs * -(-max_len // 16) + 1  # every engine the same pool, all the batch can use

    def engine_for(lora: bool, max_num_seqs: int, max_tokens: int) -> LLMEngine:
        flags = dict(enable_lora=True, max_loras=a.max_loras or a.adapters, max_lora_rank=a.rank) if lora else {}
        e = LLMEngine(
            EngineConfig(
                model=str(DEFAULT_MODEL),
                dtype=dtype,
                max_model_len=max_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_tokens,
                num_pages=pages if max_num_seqs > 1 else None,
                smallest_token_bucket=min(a.smallest_bucket, max_tokens),
                decode_steps=a.decode_steps,
                enable_prefix_caching=False,
                max_cpu_loras=a.adapters if lora else None,
                **flags,
            ),
            model=model,
        )
        t = time.perf_counter()
        for lr in loras if lora else []:
            e.add_lora(lr)
        if lora:
            print(f"adapters loaded in {time.perf_counter() - t:.1f} s")
        e.warmup()
        return e

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.requests)]
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    warm = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)
    spread = [loras[i % len(loras)] for i in range(a.requests)]
    figures: dict = {"shape": a.shape, "dtype": dtype, "device": str(jax.devices()[0].device_kind)}
    figures["gather_max_tokens"] = lora_layers.GATHER_MAX_TOKENS  # CAPSTAN_LORA_GATHER_MAX_TOKENS
    figures["gather_way"] = lora_layers.GATHER_WAY  # CAPSTAN_LORA_GATHER_WAY
    figures.update(requests=a.requests, adapters=a.adapters, rank=a.rank, max_loras=a.max_loras or a.adapters)
    batch_runs = (("base", False, None), ("lora", True, spread), ("lora_engine_base_rows", True, None))
    for label, lora, adapters in batch_runs if a.batch else ():
        engine = engine_for(lora, a.max_num_seqs, a.max_num_batched_tokens)
        run(engine, prompts[: len(loras)], warm, loras=loras if adapters else None)  # every adapter in its slot
        result = run(engine, prompts, params, loras=adapters)
        figures[f"{label}_output_tokens_per_s"] = result["output_tokens_per_s"]
        figures[f"{label}_seconds"] = result["seconds"]
        figures[f"{label}_compile_s"] = engine.compile_seconds
        del engine
    if a.batch:
        figures["lora_vs_base"] = figures["lora_output_tokens_per_s"] / figures["base_output_tokens_per_s"]
    if a.single_stream_tokens:
        one = SamplingParams(max_tokens=a.single_stream_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
        streams = [rng.integers(0, cfg.vocab_size, a.prompt_len).tolist() for _ in range(3)]
        for label, lora in (("base", False), ("lora", True)):
            single = engine_for(lora, 1, max(a.prompt_len, 16))
            pick = [loras[0]] if lora else None
            run(single, prompts[:1], warm, loras=pick)
            results = [run(single, [p], one, loras=pick, digest=True) for p in streams]
            runs = sorted(1000 * r["seconds"] / a.single_stream_tokens for r in results)
            figures[f"{label}_single_stream_tokens_digest"] = results[0]["tokens_digest"]
            figures[f"{label}_single_stream_ms_per_token"] = runs[1]  # the median of three streams
            if a.trace:  # kernel by kernel: benchmarks/trace_summary.py DIR/label
                short = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0, detokenize=False)
                with jax.profiler.trace(f"{a.trace}/{label}", create_perfetto_trace=True):
                    run(single, [streams[0]], short, loras=pick)
            del single
        figures["single_stream_lora_vs_base"] = (
            figures["lora_single_stream_ms_per_token"] / figures["base_single_stream_ms_per_token"]
        )
    for k, v in figures.items():
        print(f"{k:>42}: {v:.4g}" if isinstance(v, float) else f"{k:>42}: {v}")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
