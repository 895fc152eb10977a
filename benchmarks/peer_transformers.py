"""Hugging Face transformers as a peer: random-weight Llama shapes, no download (torch + CUDA + transformers 5.x).

python benchmarks/peer_transformers.py --shape llama-3.2-1b --requests 256 --prompt-len 256 --output-len 256 \
    --single-tokens 256 --json benchmarks/out/peer_transformers.json
python benchmarks/peer_transformers.py --shape llama-3-8b --phases single --single-tokens 256

batch:  model.generate_batch (continuous batching), ContinuousBatchingConfig(use_cuda_graph=True,
        default_compile_level=1) or ContinuousBatchingConfig() with --cb-default; the first call warms up (graphs,
        compile) and keeps its manager (persistent_manager=True), the second call on fresh prompts is timed.
single: model.generate(cache_implementation="static"): transformers compiles the decode forward itself
        (CompileConfig defaults: inductor, mode="reduce-overhead"); one warm-up call, then --single-reps timed calls.
EOS is off everywhere (eos_token_id=None; generate_batch turns that into -1), so every request yields exactly N tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope=None,
    ),
}
ROPE_THETA = 500000.0


def log(*a):
    print(*a, flush=True)


def build_model(shape: str) -> LlamaForCausalLM:
    spec = dict(SHAPES[shape])
    rope = spec.pop("rope")
    common = dict(vocab_size=128256, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None, **spec)
    if int(transformers.__version__.split(".")[0]) >= 5:  # v5: rope_theta and scaling live in rope_parameters
        config = LlamaConfig(
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, **(rope or {})}, **common
        )
    else:  # v4: rope_theta + rope_scaling
        config = LlamaConfig(rope_theta=ROPE_THETA, rope_scaling=rope, **common)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():  # random N(0, 0.02) matrices (norm weights stay 1), whatever the constructor did
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model.eval()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def batch_phase(model, args) -> dict:
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation import ContinuousBatchingConfig

    def cb_config():
        if args.cb_default:
            return ContinuousBatchingConfig()
        return ContinuousBatchingConfig(use_cuda_graph=True, default_compile_level=1)

    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=None)
    vocab = model.config.vocab_size
    original_attn = model.config._attn_implementation
    if args.cb_attn:  # e.g. "paged|sdpa" or "paged|flash_attention_2"; else generate_batch picks (flash if available)
        model.set_attn_implementation(args.cb_attn)
    keep = not args.fresh_manager
    out: dict[str, Any] = {
        "config": "ContinuousBatchingConfig()"
        if args.cb_default
        else "ContinuousBatchingConfig(use_cuda_graph=True, default_compile_level=1)",
        "persistent_manager": keep,
    }
    try:
        # Different prompts per run: with a kept manager, identical prompts would hit the prefix cache.
        for run, seed in (("warmup", args.seed + 1), ("timed", args.seed)):
            prompts = random_prompts(args.requests, args.prompt_len, vocab, seed)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            results = model.generate_batch(
                inputs=prompts,
                generation_config=gen,
                continuous_batching_config=cb_config(),
                progress_bar=False,
                persistent_manager=keep,
            )
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens = sum(len(r.generated_tokens) for r in results.values())
            failed = sum(1 for r in results.values() if getattr(r, "error", None) is not None)
            out[run] = {
                "seconds": seconds,
                "output_tokens": tokens,
                "expected_tokens": args.requests * args.output_len,
                "results": len(results),
                "failed": failed,
                "output_tokens_per_s": tokens / seconds,
            }
            log(f"[batch] {run}: {seconds:.2f} s, {tokens} tokens ({failed} failed), {tokens / seconds:.1f} tok/s")
            if tokens != args.requests * args.output_len:
                log(f"[batch] WARNING: expected {args.requests * args.output_len} tokens from {args.requests} requests")
    finally:
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        if model.config._attn_implementation != original_attn:
            model.set_attn_implementation(original_attn)
    out["output_tokens_per_s"] = out["timed"]["output_tokens_per_s"]
    return out


def single_phase(model, args) -> dict:
    n = args.single_tokens
    ids = torch.tensor(random_prompts(1, args.prompt_len, model.config.vocab_size, args.seed + 7), device="cuda")
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        min_new_tokens=n,
        max_new_tokens=n,
        cache_implementation="static",
        pad_token_id=0,
        eos_token_id=None,
    )

    def once() -> tuple[float, int]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        seq = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, seq.shape[1] - ids.shape[1]

    warm_s, _ = once()  # compiles the decode forward (and records CUDA graphs)
    log(f"[single] warm-up (compile): {warm_s:.1f} s, compiled decode forward: {hasattr(model, '_compiled_call')}")
    runs = [once() for _ in range(args.single_reps)]
    generated = runs[-1][1]
    ms = [1000 * s / g for s, g in runs]
    for (s, g), m in zip(runs, ms, strict=True):
        log(f"[single] {g} tokens in {s:.3f} s: {m:.3f} ms/token")
    return {
        "warmup_seconds": warm_s,
        "generated_tokens": generated,
        "expected_tokens": n,
        "ms_per_token_runs": ms,
        "ms_per_token": statistics.median(ms),
        "compiled": hasattr(model, "_compiled_call"),
        "attn_implementation": model.config._attn_implementation,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--phases", default=None, help="comma list of batch,single (default: both; single for 8b)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--single-tokens", type=int, default=256)
    ap.add_argument("--single-reps", type=int, default=3)
    ap.add_argument("--cb-default", action="store_true", help="plain ContinuousBatchingConfig()")
    ap.add_argument("--cb-attn", default=None, help='attention for generate_batch, e.g. "paged|sdpa"')
    ap.add_argument("--fresh-manager", action="store_true", help="time a second call that rebuilds its manager")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    phases = (args.phases or ("single" if args.shape == "llama-3-8b" else "batch,single")).split(",")

    torch.manual_seed(args.seed)
    report = {
        "shape": args.shape,
        "args": vars(args),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0),
        "phases": {},
    }
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {report['device']}")
    t0 = time.perf_counter()
    model = build_model(args.shape)
    params = sum(p.numel() for p in model.parameters())
    log(
        f"built {args.shape}: {params / 1e9:.2f} B params in {time.perf_counter() - t0:.1f} s, "
        f"attn {model.config._attn_implementation}"
    )
    for phase in phases:
        fn = {"batch": batch_phase, "single": single_phase}.get(phase.strip())
        if fn is None:
            log(f"unknown phase {phase!r}")
            continue
        try:
            report["phases"][phase] = fn(model, args)
        except Exception as e:  # keep the other phases' numbers
            traceback.print_exc()
            log(f"[{phase}] FAILED: {type(e).__name__}: {e}")
            report["phases"][phase] = {"error": f"{type(e).__name__}: {e}"}
        torch.cuda.empty_cache()

    log(f"\n{'phase':<8} {'metric':<26} {'value':>12}")
    batch, single = report["phases"].get("batch"), report["phases"].get("single")
    if batch is not None:
        value = f"{batch['output_tokens_per_s']:.1f}" if "error" not in batch else "FAILED"
        log(f"{'batch':<8} {'output tokens/s':<26} {value:>12}")
    if single is not None:
        value = f"{single['ms_per_token']:.3f}" if "error" not in single else "FAILED"
        log(f"{'single':<8} {'ms per generated token':<26} {value:>12}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
