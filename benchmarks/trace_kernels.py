"""GPU kernels of torch.profiler Chrome traces, by kind, side by side.

    python benchmarks/trace_kernels.py NAME=TRACE.json [NAME=TRACE.json ...] [--top 12]

For each trace (one profiled step, as ``profile.steps=1`` or torchtitan's profiler writes):
the kernels' summed time and count by kind (GEMMs, attention, Triton-generated, NCCL, the
other eager kernels, copies and fills), the GPU's span (first kernel's start to last kernel's
end) and the share of it with no kernel running, then the ``--top`` kernels by time. Kernel
time sums each kernel's duration (concurrent streams would count twice; a one-GPU step runs
on one compute stream). Why not ``torch.profiler``'s own ``key_averages``: it needs the live
profiler object; a trace file is what both tools leave behind.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

KINDS = (  # first match wins
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|_mm_", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("triton", re.compile(r"^triton_", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
)


def kind_of(name: str, category: str) -> str:
    """The kind of one trace event (module docstring): its category for copies and fills."""
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copy/fill"
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other eager"


def load_kernels(path: Path) -> list[dict]:
    """The GPU events (kernels, copies, fills) of a Chrome trace file (``.json`` or ``.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    return [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]


def summary(path: Path, top: int) -> dict:
    """{'span_ms', 'idle_share', 'kinds': {kind: [ms, count]}, 'top': [[name, ms, count]]}."""
    kernels = load_kernels(path)
    if not kernels:
        return {"span_ms": 0.0, "idle_share": None, "kinds": {}, "top": []}
    start = min(k["ts"] for k in kernels)
    end = max(k["ts"] + k["dur"] for k in kernels)
    kinds, names = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for k in kernels:
        for table, key in ((kinds, kind_of(k["name"], k["cat"])), (names, k["name"])):
            table[key][0] += k["dur"] / 1e3
            table[key][1] += 1
    busy = sum(ms for ms, _ in kinds.values())
    ranked = sorted(names.items(), key=lambda item: -item[1][0])[:top]
    return {
        "span_ms": (end - start) / 1e3,
        "idle_share": max(0.0, 1 - busy / ((end - start) / 1e3)),
        "kinds": dict(kinds),
        "top": [[name[:90], ms, n] for name, (ms, n) in ranked],
    }


def compare_traces(traces: dict[str, Path], top: int = 12) -> dict:
    """Print the traces' summaries side by side; returns {name: summary}."""
    found = {name: summary(Path(path), top) for name, path in traces.items()}
    names = list(found)
    print("kind".ljust(14) + "".join(f"{n:>24}" for n in names))
    kinds = sorted({k for s in found.values() for k in s["kinds"]})
    for kind in kinds + ["span", "idle share"]:
        cells = []
        for n in names:
            s = found[n]
            if kind == "span":
                cells.append(f"{s['span_ms']:.2f} ms")
            elif kind == "idle share":
                cells.append("n/a" if s["idle_share"] is None else f"{s['idle_share']:.1%}")
            else:
                ms, count = s["kinds"].get(kind, (0.0, 0))
                cells.append(f"{ms:.2f} ms ({count})")
        print(kind.ljust(14) + "".join(f"{c:>24}" for c in cells))
    for n in names:
        print(f"-- {n}: top kernels")
        for name, ms, count in found[n]["top"]:
            print(f"   {ms:8.2f} ms {count:5d}x  {name}")
    return found


def main(argv: list[str] | None = None) -> int:
    """Print the comparison of the NAME=TRACE arguments; 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="NAME=PATH")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    compare_traces(dict(t.split("=", 1) for t in args.traces), args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
