"""CPU decode of the default model (SmolLM2-135M-Instruct Q4_1 GGUF), variants compared back to back in one run.

python benchmarks/cpu_decode.py --streams 1 16 --repeats 3
python benchmarks/cpu_decode.py --variant rows=off --variant rows=on --streams 1 16
python benchmarks/cpu_decode.py --variant weights=float32 --variant weights=int8 --streams 1 16
python benchmarks/cpu_decode.py --variant '' --variant temperature=0.2,top_p=0.9,penalty=1.1,frequency=0.3,presence=0.3
    (greedy against the default model's sampling defaults, runtime/generation_config.py's SMOLLM2_RECOMMENDED)

Each variant is an engine over the same loaded checkpoint (offline, in this process: no HTTP), with the engine's
settings of benchmarks/llamacpp_compare.py (max_model_len 512, 16 rows, 256-token budget) unless a variant changes
them. A round runs N streams (prompts of --prompt-words words, --max-tokens tokens each, EOS ignored) and reports
output tokens/s over the whole round (prefill included) and the process's CPU milliseconds per output token (all
threads: the steadier figure on a shared machine). Rounds alternate between variants, so each variant meets the
same load; the median of --repeats rounds is printed with the load average.

A variant is key=value[,key=value]: rows=on|off (decode-row buckets), steps=N (decode steps per dispatch),
penalty=X (repetition_penalty of every request), frequency=X, presence=X (their penalties), temperature=X,
top_p=X, seqs=N (max_num_seqs), weights=int8|none|fp8 (--quantization; none: the GGUF dequantized to float32;
default: the engine's, int8 on CPU)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve import WORDS  # noqa: E402  (the load generator's prompt words)

from capstan.runtime.config import EngineConfig, installed_smollm2  # noqa: E402
from capstan.runtime.engine.engine import LLMEngine  # noqa: E402
from capstan.runtime.sampling.sampling_params import SamplingParams  # noqa: E402


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def parse_variant(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if part)


def engine_for(variant: dict[str, str], gguf: str, models: dict, args) -> tuple[LLMEngine, float]:
    """The variant's engine, warmed up, and its warm-up's process CPU seconds."""
    from capstan.runtime.models.loader import load_model

    weights = variant.get("weights", "")
    if weights not in models:
        models[weights] = load_model(Path(gguf), "float32", weights or None)
    rows = variant.get("rows")
    config = EngineConfig(
        model=gguf,
        max_model_len=args.max_model_len,
        max_num_seqs=int(variant.get("seqs", 16)),
        max_num_batched_tokens=256,
        decode_steps=int(variant.get("steps", 16)),
        decode_row_buckets=None if rows is None else rows == "on",
        num_pages=int(variant.get("seqs", 16)) * (args.max_model_len // 16) + 1,
    )
    engine = LLMEngine(config, model=models[weights])
    start = time.process_time()
    engine.warmup()
    return engine, time.process_time() - start


def one_round(
    engine: LLMEngine, variant: dict[str, str], streams: int, rng: random.Random, args
) -> tuple[float, float]:
    """(output tokens/s, process CPU ms per output token) of `streams` requests run together to the end."""
    params = SamplingParams(
        max_tokens=args.max_tokens,
        ignore_eos=True,
        temperature=float(variant.get("temperature", 0.0)),
        seed=0,
        repetition_penalty=float(variant.get("penalty", 1.0)),
        top_p=float(variant.get("top_p", 1.0)),
        frequency_penalty=float(variant.get("frequency", 0.0)),
        presence_penalty=float(variant.get("presence", 0.0)),
        detokenize=False,
    )
    for i in range(streams):
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, params)
    wall, cpu, tokens = time.perf_counter(), time.process_time(), 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += sum(len(o.token_ids) for o in out.outputs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert tokens == streams * args.max_tokens, tokens
    return tokens / wall, 1000 * cpu / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=None, help="key=value[,key=value] (repeatable)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--gguf", default=None)
    args = parser.parse_args()
    gguf = args.gguf or str(installed_smollm2())
    variants = [parse_variant(v) for v in (args.variant or [""])]
    print(f"load average at start: {load_average()}", flush=True)
    models: dict = {}
    engines = []
    for v in variants:
        engine, warmup_s = engine_for(v, gguf, models, args)
        engines.append(engine)
        print(f"{v or 'defaults'}: warm-up {warmup_s:.1f} s CPU", flush=True)
    results: dict[tuple[int, int], list[tuple[float, float]]] = {}
    rng = random.Random(0)
    for engine, v in zip(engines, variants, strict=True):  # one round each first: lazy set-up outside the figures
        one_round(engine, v, 1, rng, argparse.Namespace(**{**vars(args), "max_tokens": 4}))
    for _ in range(args.repeats):
        for streams in args.streams:
            for i, (engine, v) in enumerate(zip(engines, variants, strict=True)):
                results.setdefault((i, streams), []).append(one_round(engine, v, streams, rng, args))
    rows = []
    for (i, streams), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        tok_s = statistics.median(r[0] for r in runs)
        cpu_ms = statistics.median(r[1] for r in runs)
        rows.append(
            {"variant": variants[i] or "defaults", "streams": streams, "tok_s": tok_s, "cpu_ms_per_tok": cpu_ms}
        )
        print(
            f"{json.dumps(variants[i] or 'defaults'):40s} streams {streams:3d}: {tok_s:7.1f} tokens/s  "
            f"{cpu_ms:6.1f} CPU ms/token  (runs: {', '.join(f'{r[0]:.1f}' for r in runs)})",
            flush=True,
        )
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
