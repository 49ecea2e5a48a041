"""How much does the runner cost over a minimal hand-written FSDP2 loop?

    .venv/bin/python benchmarks/overhead.py [--model llama3_debug] [--steps 12] [--warmup 4]

For each layout (fsdp: dp_shard=2; fsdp_tp: dp_shard=2 x tp=2), side by side with the same
model, mesh, global batch, steps and loss (under TP both compute it on the vocabulary-sharded
logits with torch's ``loss_parallel``, the runner's default ``parallel.loss_parallel=true``):
- ``python -m hsdp_runner`` (defaults, ``logger=none``), and
- ``torchrun --standalone`` + ``benchmarks/minimal_fsdp.py``.
Prints the steady-state (median after ``--warmup`` steps) step time of each and their ratio,
and the wall time of each command and their ratio. The step time is the same region in both
(train step through the loss on the host); what the runner does around it (metrics, console,
start-up checks, W&B when on) shows in the wall time. The last line is
``step_time_ratio=<x> wall_ratio=<y>``: the worst layout of each. Targets: <= 1.00 (both sides
doing the same work), <= 1.15. Each pair runs ``--repeats`` times (default 5, at least 3 for a
figure to report), alternating which command goes first; each repeat's step time is the median
of its steps after warm-up. A layout's step-time ratio is the median of its pairs' ratios (a
paired comparison: the machine's drift between pairs cancels within each), printed beside the
ratio of the two sides' medians; the wall figures are medians over the repeats. Every pair also
prints its own step-time ratio and the 1-minute load average before and after it: on a machine
shared with other work a pair whose load moved is noise, not overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"fsdp": (2, 1), "fsdp_tp": (2, 2)}  # name -> (dp_shard, tp)


def _timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr[-3000:]}")
    return wall


def run_pair(name: str, dp_shard: int, tp: int, args, tmp: Path, runner_first: bool) -> dict:
    """Run the runner and the minimal loop for one layout; return their step medians and walls."""
    world = dp_shard * tp
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)),
    }
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    out = tmp / f"{name}_minimal.json"
    minimal = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "benchmarks/minimal_fsdp.py",
        f"--dp-shard={dp_shard}",
        f"--tp={tp}",
        f"--model={args.model}",
        f"--steps={args.steps}",
        f"--batch={args.batch}",
        f"--out={out}",
    ]
    job = tmp / f"{name}_runner_{time.monotonic_ns()}"
    runner = [
        sys.executable,
        "-m",
        "hsdp_runner",
        f"hydra.run.dir={job}",
        "parallel=fsdp_tp",
        "parallel.dp_replicate=1",
        f"parallel.dp_shard={dp_shard}",
        f"parallel.tp={tp}",
        f"model={args.model}",
        f"trainer.steps={args.steps}",
        f"trainer.global_batch_size={args.batch}",
        "logger=none",
    ]
    load_before = os.getloadavg()[0]
    if runner_first:
        wall_run, wall_min = _timed(runner, env), _timed(minimal, env)
    else:
        wall_min, wall_run = _timed(minimal, env), _timed(runner, env)
    min_times = json.loads(out.read_text())["step_time_s"]
    run_times = [
        json.loads(line)["step_time_s"] for line in (job / "metrics.jsonl").read_text().splitlines()
    ]
    runner_step = statistics.median(run_times[args.warmup :])
    minimal_step = statistics.median(min_times[args.warmup :])
    print(
        f"  {name} pair ({'runner' if runner_first else 'minimal'} first): step time runner "
        f"{runner_step:.3f} s, minimal {minimal_step:.3f} s, ratio "
        f"{runner_step / minimal_step:.3f}; load {load_before:.1f} -> {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return {
        "runner_step": runner_step,
        "minimal_step": minimal_step,
        "runner_wall": wall_run,
        "minimal_wall": wall_min,
        # what the wall time spends outside the timed steps: start-up, teardown, reporting
        "runner_outside": wall_run - sum(run_times),
        "minimal_outside": wall_min - sum(min_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="pairs per layout, alternating which goes first; each figure is "
        "the median over the repeats",
    )
    args = parser.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {platform.processor() or ''} "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; model={args.model} "
        f"steps={args.steps} (median of the last {args.steps - args.warmup}) batch={args.batch} "
        f"repeats={args.repeats}"
    )
    step_ratios, wall_ratios = [], []
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        for name in args.layouts.split(","):
            dp_shard, tp = LAYOUTS[name]
            runs = [
                run_pair(name, dp_shard, tp, args, Path(tmp), runner_first=i % 2 == 1)
                for i in range(args.repeats)
            ]
            r = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            paired = statistics.median(run["runner_step"] / run["minimal_step"] for run in runs)
            step_ratios.append(paired)
            wall_ratios.append(r["runner_wall"] / r["minimal_wall"])
            print(
                f"{name:8s} (dp_shard={dp_shard}, tp={tp}): step time runner "
                f"{r['runner_step']:.3f} s, minimal {r['minimal_step']:.3f} s, ratio "
                f"{step_ratios[-1]:.3f} (of the medians {r['runner_step'] / r['minimal_step']:.3f})"
                f" | wall python -m hsdp_runner {r['runner_wall']:.1f} s, "
                f"torchrun + minimal {r['minimal_wall']:.1f} s, ratio {wall_ratios[-1]:.3f} | "
                f"outside the steps: runner {r['runner_outside']:.1f} s, minimal "
                f"{r['minimal_outside']:.1f} s",
                flush=True,
            )
    print(f"step_time_ratio={max(step_ratios):.3f} wall_ratio={max(wall_ratios):.3f}")


if __name__ == "__main__":
    main()
