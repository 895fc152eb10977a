"""Single-stream decode and prefill time against the real context, with a long max_model_len (CPU first).

python benchmarks/context_decode.py --contexts 64 2000 --max-model-len 4096 [--attention reference]
python benchmarks/context_decode.py --shape qwen3-0.6b --contexts 64 2000 --tokens 17
python benchmarks/context_decode.py --model SmolLM2-135M-Instruct.Q4_1.gguf --max-num-seqs 4 --contexts 64 2000
Runs the embedded default checkpoint (or --shape with random weights) with the engine's own defaults otherwise
(max_num_seqs, token budget, multi-step decode), one stream at a time, and prints per context: decode ms/token
(after the first token, wall and CPU time), prefill seconds (prompt to first token), plus the warm-up compile time."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402

from capstan.runtime.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.models.loader import random_model  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402


def one_stream(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[float, float, float]:
    """(prefill seconds to the first token, decode ms per later token, decode CPU ms per later token) of one
    request run alone; CPU time (all threads) is the steadier figure on a shared machine."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, detokenize=False)
    engine.add_request(f"c{time.monotonic_ns()}", prompt, params)
    start, first, produced = time.perf_counter(), None, 0
    while engine.has_unfinished():
        for out in engine.step():
            produced += sum(len(o.token_ids) for o in out.outputs)
        if first is None and produced:
            first, first_cpu = time.perf_counter(), time.process_time()
    end, end_cpu = time.perf_counter(), time.process_time()
    assert first is not None, "the request produced no token"
    return first - start, 1000 * (end - first) / (tokens - 1), 1000 * (end_cpu - first_cpu) / (tokens - 1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", help="a named shape with random weights instead of the embedded checkpoint")
    ap.add_argument("--model", help="a checkpoint folder or .gguf file instead of the embedded checkpoint")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 2000])
    ap.add_argument("--tokens", type=int, default=65, help="tokens generated per stream (the first is prefill's)")
    ap.add_argument("--streams", type=int, default=3, help="streams per context; the median is reported")
    ap.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    ap.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps)
    ap.add_argument(
        "--attention",
        choices=["chunked", "reference"],
        default="chunked",
        help="reference: the engine before chunked attention (every token reads max_model_len keys)",
    )
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    if a.attention == "reference":
        import capstan.runtime.attention as attention

        attention.chunked_attention = attention.paged_attention  # attend()'s CPU path, as it was
    config = EngineConfig(
        model=a.model or str(DEFAULT_MODEL),
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        decode_steps=a.decode_steps,
        enable_prefix_caching=False,
    )
    model = None
    if a.shape:
        config.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        model = random_model(shape_config(a.shape), config.dtype)
    engine = LLMEngine(config, model=model)
    engine.warmup()
    vocab = engine.model.cfg.vocab_size
    rng = np.random.default_rng(0)
    one_stream(engine, rng.integers(0, vocab, 8).tolist(), 4)  # first-call costs outside the figures
    figures = {
        "model": a.shape or a.model or "default",
        "attention": a.attention,
        "device": str(jax.devices()[0].device_kind),
        "max_model_len": a.max_model_len,
        "compile_s": round(engine.compile_seconds, 2),
    }
    for ctx in a.contexts:
        runs = [one_stream(engine, rng.integers(0, vocab, ctx).tolist(), a.tokens) for _ in range(a.streams)]
        figures[f"ctx{ctx}_decode_ms_per_token"] = round(statistics.median(r[1] for r in runs), 3)
        figures[f"ctx{ctx}_decode_cpu_ms_per_token"] = round(statistics.median(r[2] for r in runs), 3)
        figures[f"ctx{ctx}_prefill_s"] = round(statistics.median(r[0] for r in runs), 3)
    for k, v in figures.items():
        print(f"{k:>28}: {v}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
