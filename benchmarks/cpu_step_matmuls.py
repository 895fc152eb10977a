"""A one-token decode step's native matmuls on this CPU, outside XLA: SmolLM2-135M-Instruct's 120 layer matmuls
(Q4_1, each layer its own weights, so they stream from memory as in the model) and its LM head (Q8_0), through
runtime/kernels/cpu/block_matmul.cc's own multiply(), built here with g++ against jaxlib's FFI headers:

    python benchmarks/cpu_step_matmuls.py                        # levels 1 and 2, 2 threads, 1 row
    python benchmarks/cpu_step_matmuls.py --threads 1 2 --rows 1 4 --distinct 1 30 --repeats 3

--distinct 1: every layer shares one layer's weights (2.2 MB, from the cache): the kernel's arithmetic alone, which
the gap to --distinct 30 separates from the memory's share. --levels 0 only reads the same bytes on the same threads
(the floor a memory-bound step cannot beat). Random weights: the speed does not depend on the
values. Each line is the median (and minimum) over --tokens steps; --repeats alternates the configurations."""

from __future__ import annotations

import argparse
import itertools
import subprocess
import tempfile
from pathlib import Path

import jax

HERE = Path(__file__).resolve().parent


def build(out: Path) -> Path:
    binary = out / "cpu_step_matmuls"
    subprocess.run(["g++", "-O3", "-std=c++17", "-pthread", "-isystem", jax.ffi.include_dir(),
                    str(HERE / "cpu_step_matmuls.cc"), "-o", str(binary)], check=True)  # fmt: skip
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--levels", type=int, nargs="+", default=[0, 1, 2], help="activation levels (0: only read the weights)"
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--distinct", type=int, nargs="+", default=[30])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"load average {load}")
    print("| activation levels | threads | rows | distinct layers | 120 layer matmuls ms (min) | LM head ms (min) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for _ in range(args.repeats):
            for levels, threads, rows, distinct in itertools.product(
                args.levels, args.threads, args.rows, args.distinct
            ):
                out = subprocess.run([str(binary), str(levels), str(threads), str(rows), str(distinct), str(args.tokens)],
                                     check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
                lm, lmin, hm, hmin = (float(v) for v in out[4:8])
                print(
                    f"| {levels} | {threads} | {rows} | {distinct} | {lm:.3f} ({lmin:.3f}) | {hm:.3f} ({hmin:.3f}) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
