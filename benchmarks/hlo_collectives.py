"""The collectives XLA put in each optimized HLO module (tensor parallel diagnostic): how many all-reduces,
all-gathers, reduce-scatters, collective-permutes and all-to-alls, with their shapes, for the largest modules.

XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" python benchmarks/throughput.py ... --tensor-parallel-size 2
python benchmarks/hlo_collectives.py /tmp/hlo [--top 4]"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# `%name = bf16[256,4096]{1,0} all-reduce(...)`, also the -start halves of async collectives
LINE = re.compile(r"=\s*(\S+)\s+(" + "|".join(OPS) + r")(?:-start)?\(")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump_dir")
    ap.add_argument("--top", type=int, default=4, help="the N largest modules (the decode and prefill steps)")
    a = ap.parse_args()
    files = sorted(Path(a.dump_dir).glob("*after_optimizations.txt"), key=lambda f: f.stat().st_size, reverse=True)
    for f in files[: a.top]:
        text = f.read_text()
        found = collections.Counter(f"{op} {shape}" for shape, op in LINE.findall(text))
        loops = text.count(" while(")
        print(f"{f.name}: {f.stat().st_size // 1024} KiB, {sum(found.values())} collectives, {loops} while loops")
        for what, n in found.most_common(20):
            print(f"  {n:5d}x {what}")


if __name__ == "__main__":
    main()
