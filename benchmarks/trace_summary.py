"""Summarises a Perfetto trace from `decode_profile.py --trace DIR`: GPU kernels by total time.

python benchmarks/trace_summary.py DIR/rows1 [--top 30] [--sequence 40]
--sequence N: also N consecutive kernels from the middle of the trace, in order, each with its gap after the last
(one layer's chain of launches: whether the GPU waits between them).
--gaps N: per GPU, where it idles: the N pairs (kernel before, kernel after) holding the most idle time between
them (a TP=2 decode step idles 22% of its span against 11% at TP=1: around the all-reduces, or elsewhere?)."""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sequence", type=int, default=0)
    ap.add_argument("--gaps", type=int, default=0)
    a = ap.parse_args()
    path = next(Path(a.trace_dir).rglob("*.trace.json.gz"))
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {
        (e.get("pid"), e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    pids = {e.get("pid"): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    span = [float("inf"), 0.0]
    kernels = []
    by_device: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
    per_device: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, float("inf"), 0.0])  # busy, start, end
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        where = f"{pids.get(e.get('pid'), '')} {names.get((e.get('pid'), e.get('tid')), '')}"
        if "GPU" not in where.upper() and "STREAM" not in where.upper():
            continue
        kernels.append((e["ts"], e["dur"], e["name"]))
        device = pids.get(e.get("pid"), "")
        by_device[device].append((e["ts"], e["dur"], e["name"]))
        per_device[device][0] += e["dur"]
        per_device[device][1] = min(per_device[device][1], e["ts"])
        per_device[device][2] = max(per_device[device][2], e["ts"] + e["dur"])
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
        span = [min(span[0], e["ts"]), max(span[1], e["ts"] + e["dur"])]
    if not total:
        print("no GPU events; processes:", sorted(set(pids.values()))[:20])
        return
    busy = sum(total.values())
    print(
        f"{path}: {sum(count.values())} GPU events, busy {busy / 1000:.3f} ms, span {(span[1] - span[0]) / 1000:.3f} ms"
    )
    if len(per_device) > 1:  # tensor parallel: each GPU's own busy time against its own span
        for device, (busy_us, start, end) in sorted(per_device.items()):
            print(f"  {device[:60]}: busy {busy_us / 1000:.3f} ms, span {(end - start) / 1000:.3f} ms")
    for name, us in total.most_common(a.top):
        print(f"{us / 1000:9.3f} ms {count[name]:6d}x  {name[:110]}")
    if a.gaps:
        for device, events_on in sorted(by_device.items()):
            print_gaps(device, events_on, a.gaps)
    if a.sequence:
        kernels.sort()
        start = len(kernels) // 2
        print(f"{a.sequence} kernels in order from #{start}: duration, gap before it (us)")
        end = kernels[start - 1][0] + kernels[start - 1][1]
        for ts, dur, name in kernels[start : start + a.sequence]:
            print(f"{dur:8.1f} {ts - end:8.1f}  {name[:100]}")
            end = max(end, ts + dur)


def print_gaps(device: str, kernels: list[tuple[float, float, str]], top: int) -> None:
    """The idle time between one device's kernels (nothing running on any of its streams), summed by the pair of
    kernels around each gap."""
    kernels = sorted(kernels)
    idle: dict[tuple[str, str], float] = collections.defaultdict(float)
    gaps: collections.Counter[tuple[str, str]] = collections.Counter()
    end, before = kernels[0][0] + kernels[0][1], kernels[0][2]
    for ts, dur, name in kernels[1:]:
        if ts > end:
            idle[before, name] += ts - end
            gaps[before, name] += 1
        if ts + dur >= end:
            end, before = ts + dur, name
    print(
        f"{device[:60]}: idle {sum(idle.values()) / 1000:.3f} ms in {sum(gaps.values())} gaps; the most, by the kernels around them:"
    )
    for (after, next_), us in sorted(idle.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{us / 1000:9.3f} ms {gaps[after, next_]:6d}x  {after[:50]} -> {next_[:50]}")


if __name__ == "__main__":
    main()
