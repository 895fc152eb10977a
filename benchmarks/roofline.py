"""Each measured figure against what the GPU's memory system and matmul units allow (issue 64).

For a run of throughput.py (its --json report), the bytes every step must read (the weights once a step, each
row's K/V so far, the logits written and read back) and the FLOPs (2 per weight per token, attention's QK and PV),
against this device's measured memory bandwidth (the best of a copy, a sum and a GEMV over 2 GiB, JAX's, and
PyTorch's copy and sum where it is there) and bf16 matmul rate, measured in the same process. The bound of a
phase is the larger of its bytes / bandwidth and its FLOPs / matmul rate; the fraction is bound / measured (1.0: at
the roofline).

    python3 benchmarks/roofline.py --report OUT/capstan-llama-3.2-1b.json [--report OUT/capstan-llama-3-8b.json]
    python3 benchmarks/roofline.py --shape llama-3.2-1b --rows 1 --context 384 --measured-ms 0.987   # one figure

A report's batch (requests x prompt -> output tokens) is one prefill phase (every prompt once: compute-bound) and
output_len decode steps of `requests` rows (K/V read grows by a token a step); its single-stream figure is a decode
step of one row at the mid-point of the prompt and its output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402

LOGIT_BYTES = 4  # float32 logits: written by the lm_head, read by the sampler
# what the vendor's datasheet promises (HBM bytes/s, dense bf16 FLOP/s): measured kernels reach 70-90% of it
DATASHEET = {"NVIDIA H200": (4.8e12, 989e12), "NVIDIA H100 80GB HBM3": (3.35e12, 989e12)}


@dataclasses.dataclass
class Device:
    bandwidth: float  # bytes/s: the best of copies (reads plus writes), sums and a GEMV streaming 2 GiB
    matmul: float  # FLOP/s, bf16
    name: str
    rates: dict = dataclasses.field(default_factory=dict)  # bytes/s by the way measured

    @staticmethod
    def measure() -> Device:
        rates = torch_rates()  # before JAX takes most of the GPU's memory for itself
        import jax
        import jax.numpy as jnp

        def best(f, *args, repeats: int = 20) -> float:
            jax.block_until_ready(f(*args))
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                jax.block_until_ready(f(*args))
                times.append(time.perf_counter() - t)
            return min(times)

        n = 1 << 30  # 2 GiB of bf16: far past every cache
        x = jnp.ones((n,), jnp.bfloat16)
        rates["copy"] = 2 * 2 * n / best(jax.jit(lambda a: a * 2), x)  # read and written
        rates["sum"] = 2 * n / best(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x)  # read once
        w = x.reshape(8192, n // 8192)
        rates["gemv"] = 2 * n / best(jax.jit(lambda v, m: v @ m), jnp.ones((1, 8192), jnp.bfloat16), w)
        del x, w
        m = 8192
        a = jnp.ones((m, m), jnp.bfloat16)
        mm = best(jax.jit(lambda p, q: p @ q), a, a)
        # the best way to stream 2 GiB is the bound (a decode step reads its weights as the gemv does); PyTorch's
        # device-to-device copy (cudaMemcpy) counts too: what JAX's own kernels leave unused is ours to win
        return Device(max(rates.values()), 2 * m**3 / mm, jax.devices()[0].device_kind, rates)


def torch_rates() -> dict:
    """PyTorch's device-to-device copy and sum of 2 GiB, where PyTorch and a CUDA GPU are there (the lent GPUs)."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    n = 1 << 30

    def best(f, repeats: int = 20) -> float:
        f()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times)

    def rates() -> dict:  # (the arrays freed on return, before the cache is emptied)
        x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        return {
            "torch copy": 2 * 2 * n / best(lambda: y.copy_(x)),
            "torch sum": 2 * n / best(lambda: x.sum(dtype=torch.float32)),
        }

    measured = rates()
    torch.cuda.empty_cache()
    return measured


def weight_bytes(cfg, weight_size: float = 2.0) -> tuple[float, float]:
    """(bytes of the weights a decode step reads, the linear weights' parameter count, lm_head's included)."""
    H, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    attention = H * cfg.num_heads * hd * 2 + H * cfg.num_kv_heads * hd * 2  # q and o, k and v
    mlp = 3 * H * cfg.intermediate_size
    linear = L * (attention + mlp) + cfg.vocab_size * H  # lm_head (tied or not, it is read every step)
    norms = (2 * L + 1) * H
    return (linear + norms) * weight_size, linear


def decode_step(cfg, rows: int, context: float, kv_size: float = 2.0, weight_size: float = 2.0) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step of `rows` rows at `context` tokens each."""
    weights, linear = weight_bytes(cfg, weight_size)
    kv = rows * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_size
    logits = rows * cfg.vocab_size * LOGIT_BYTES * 2
    attention_flops = 4 * rows * context * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return weights + kv + logits, 2 * linear * rows + attention_flops


def prefill(cfg, requests: int, prompt: int, kv_size: float = 2.0) -> tuple[float, float]:
    """(bytes, FLOPs) of every prompt's prefill: the weights once a step are small against its matmuls."""
    weights, linear = weight_bytes(cfg)
    tokens = requests * prompt
    kv_written = tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_size
    attention_flops = 2 * requests * prompt * prompt * cfg.num_heads * cfg.head_dim * cfg.num_layers  # causal half
    return weights + kv_written, 2 * linear * tokens + attention_flops


def bound(device: Device, nbytes: float, flops: float) -> tuple[float, str]:
    memory, compute = nbytes / device.bandwidth, flops / device.matmul
    return (memory, "memory") if memory >= compute else (compute, "matmul")


def line(name: str, measured_s: float, bound_s: float, limit: str, nbytes: float, flops: float) -> str:
    sheet = DATASHEET.get(DEVICE_NAME[0])
    of_sheet = f", {max(nbytes / sheet[0], flops / sheet[1]) / measured_s:.2f} of the datasheet's" if sheet else ""
    return (
        f"{name:44s} measured {1000 * measured_s:10.3f} ms  bound {1000 * bound_s:9.3f} ms ({limit}: "
        f"{nbytes / 2**30:.2f} GiB, {flops / 1e12:.2f} TFLOP)  fraction {bound_s / measured_s:.2f}{of_sheet}"
    )


DEVICE_NAME = [""]  # the device of this run (for the datasheet's figures)


def report_lines(device: Device, report: dict) -> list[str]:
    cfg = shape_config(report["shape"])
    kv = 1.0 if report.get("kv_cache_dtype", "auto").startswith("fp8") else 2.0
    out = []
    R, P, O = report["requests"], report["prompt_len"], report["output_len"]
    if "prefill_phase_s" in report and R > 1:
        nbytes, flops = prefill(cfg, R, P, kv)
        b, limit = bound(device, nbytes, flops)
        out.append(line(f"{report['shape']} prefill {R} x {P}", report["prefill_phase_s"], b, limit, nbytes, flops))
        total_bytes = total_flops = 0.0
        for step in range(O - 1):  # the first token of each comes from the prefill phase
            nbytes, flops = decode_step(cfg, R, P + step + 1, kv)
            total_bytes, total_flops = total_bytes + nbytes, total_flops + flops
        b = sum(bound(device, *decode_step(cfg, R, P + s + 1, kv))[0] for s in range(O - 1))
        limit = bound(device, total_bytes, total_flops)[1]
        out.append(line(f"{report['shape']} decode {R} rows x {O - 1} steps", report["decode_phase_s"], b, limit,
                        total_bytes, total_flops))  # fmt: skip
        whole = report["output_tokens"] / report["output_tokens_per_s"]
        b_all = bound(device, *prefill(cfg, R, P, kv))[0] + b
        out.append(
            f"{report['shape']} batch: {report['output_tokens_per_s']:.0f} output tok/s, bound "
            f"{report['output_tokens'] / b_all:.0f} (fraction {b_all / whole:.2f})"
        )
        for kind in ("single", "multi-step"):  # the host's share (throughput.py --timeline): where the rest goes
            if f"timeline_{kind}" in report:
                out.append(f"    host, {kind} steps: {report[f'timeline_{kind}']}")
    if report.get("single_stream_ms_per_token"):
        context = P + report.get("single_stream_tokens", 256) / 2
        nbytes, flops = decode_step(cfg, 1, context, kv)
        b, limit = bound(device, nbytes, flops)
        for key, how in (("single_stream_ms_per_token", ""), ("single_stream_sampled_ms_per_token", ", sampled")):
            if report.get(key):  # (sampled: throughput.py --single-stream-top-p)
                name = f"{report['shape']} one stream{how} (context {context:.0f})"
                out.append(line(name, report[key] / 1000, b, limit, nbytes, flops))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", action="append", default=[], help="a throughput.py --json report")
    ap.add_argument("--shape", help="one figure: the shape")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=float, default=384)
    ap.add_argument("--measured-ms", type=float, help="one figure: a decode step's measured ms")
    ap.add_argument("--weight-bytes", type=float, default=2.0, help="one figure: bytes a weight (FP8: 1)")
    ap.add_argument("--bandwidth-gbs", type=float, help="skip measuring: this memory bandwidth (GB/s)")
    ap.add_argument("--matmul-tflops", type=float, help="skip measuring: this bf16 matmul rate (TFLOP/s)")
    a = ap.parse_args()
    if a.bandwidth_gbs and a.matmul_tflops:
        device = Device(a.bandwidth_gbs * 1e9, a.matmul_tflops * 1e12, "given")
    else:
        device = Device.measure()
    DEVICE_NAME[0] = device.name
    print(
        f"device {device.name}: memory bandwidth {device.bandwidth / 1e9:.0f} GB/s ("
        + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in device.rates.items())
        + f"), bf16 matmul {device.matmul / 1e12:.0f} TFLOP/s (measured in this process)"
    )
    for path in a.report:
        for text in report_lines(device, json.loads(Path(path).read_text())):
            print(text)
    if a.shape and a.measured_ms:
        cfg = shape_config(a.shape)
        nbytes, flops = decode_step(cfg, a.rows, a.context, weight_size=a.weight_bytes)
        b, limit = bound(device, nbytes, flops)
        print(
            line(
                f"{a.shape} {a.rows} row(s) at {a.context:.0f}, {a.weight_bytes:g} B a weight",
                a.measured_ms / 1000,
                b,
                limit,
                nbytes,
                flops,
            )
        )


if __name__ == "__main__":
    main()
