"""The planner against published torchtitan figures, and its own speed at up to 1,024 ranks.

    python benchmarks/plan_published.py [--skip-speed] [--skip-published]

Prints predicted vs published for
- Llama 3 8B on 8x H100, FSDP 8, local batch 2, seq 8192, selective AC, bf16 (torchtitan
  docs/performance.md, Table 1: 5,762 tokens/s/GPU and 82.4 GiB eager, 6,667 and 77.0 GiB with
  torch.compile). The H100 preset's compute efficiency was *fitted* to the eager throughput, so
  that row checks the fit; its memory is predicted.
- Llama 3 70B on 256 H100, FSDP 32 x TP 8, local batch 16 (global 512), seq 8192, full AC,
  bf16, no async TP: 597 tokens/s/GPU. Predicted with the 8B's efficiency (not fitted).
Then the wall time of a cold plan (fresh cache) of the 8B and 70B shapes on 1,024 ranks.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsdp_runner import plan
from hsdp_runner.planner import memory as plan_memory  # noqa: E402

CASES = [
    {"name": "Llama 3 8B, 8x H100, FSDP 8, selective AC",
     "overrides": ["model=llama3_8b", "precision=bf16", "trainer.global_batch_size=16",
                   "parallel.ac=selective", "cluster=h100_sxm"],
     "layout": (1, 8, 1), "tps": (5762, "eager; 6,667 compiled"), "mem": (82.4, "eager; 77.0 compiled")},
    {"name": "Llama 3 70B, 256x H100, FSDP 32 x TP 8, full AC",
     "overrides": ["model=llama3_70b", "precision=bf16", "trainer.global_batch_size=512",
                   "parallel.ac=full", "cluster=h100_sxm", "cluster.nodes=32"],
     "layout": (1, 32, 8), "tps": (597, "bf16, no async TP"), "mem": None},
]


def _find(entries, shape):
    return next(e for e in entries if e["valid"] and (
        e["overrides"]["parallel.dp_replicate"], e["overrides"]["parallel.dp_shard"],
        e["overrides"]["parallel.tp"]) == shape)


def published() -> None:
    """Print the predicted-vs-published table."""
    print("| case | figure | predicted | published | error |\n|---|---|---|---|---|")
    for case in CASES:
        _, entries = plan.predict(plan.compose(case["overrides"]), {})
        entry = _find(entries, case["layout"])
        value, note = case["tps"]
        print(f"| {case['name']} | tokens/s/GPU | {entry['tps_per_device']:,.0f} | {value:,} ({note})"
              f" | {entry['tps_per_device'] / value - 1:+.0%} |")
        if case["mem"]:
            value, note = case["mem"]
            print(f"| {case['name']} | peak GiB | {entry['mem_gib']:.1f} | {value} ({note}) | "
                  f"{entry['mem_gib'] / value - 1:+.0%} |")
        print(f"|  | (breakdown) | step {entry['step_time_s']:.3g} s = compute "
              f"{entry['compute_s']:.3g} s + exposed comm {entry['exposed_comm_s']} | | |")


def speed() -> None:
    """Print the wall time of a cold plan of 8B and 70B on 1,024 ranks."""
    for model, batch in (("llama3_8b", 1024), ("llama3_70b", 1024)):
        with tempfile.TemporaryDirectory() as cache:
            plan_memory.CACHE_DIR = Path(cache)
            start, cpu = time.perf_counter(), _cpu_seconds()
            _, entries = plan.predict(plan.compose(
                [f"model={model}", "precision=bf16", f"trainer.global_batch_size={batch}",
                 "parallel.ac=selective", "cluster=h100_sxm", "cluster.nodes=128"]), {})
            took, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        valid = sum(e["valid"] for e in entries)
        print(f"{model} on 1,024 ranks: {len(entries)} layouts ({valid} valid) planned in "
              f"{took:.1f} s wall, {cpu:.1f} s CPU incl. the measuring children (cold cache; "
              f"load average {os.getloadavg()[0]:.1f})", flush=True)


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (load-independent, unlike wall)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-published", action="store_true")
    args = parser.parse_args()
    if not args.skip_published:
        published()
    if not args.skip_speed:
        speed()
