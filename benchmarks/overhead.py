"""How much does the runner cost over a minimal hand-written FSDP2 loop?

    .venv/bin/python benchmarks/overhead.py [--model llama3_debug] [--steps 40] [--warmup 4]
        [--repeats 3] [--layouts fsdp,fsdp_tp]

For each layout (fsdp: dp_shard=2; fsdp_tp: dp_shard=2 x tp=2), with the same model, mesh,
global batch and loss (under TP both compute it on the vocabulary-sharded logits with torch's
``loss_parallel``, the runner's default ``parallel.loss_parallel=true``):

- **Step time**, the target's figure: ``benchmarks/interleaved_steps.py`` under ``torchrun``
  steps the runner's own ``Trainer.fit`` and ``benchmarks/minimal_fsdp.py``'s loop in turn in
  the same processes, ``--steps`` steps each (the two loops take turns a step at a time, so the
  machine's drift reaches both alike). Each step's ratio pairs the runner's step with the
  minimal loop's beside it; the layout's ratio is the median of the pairs after ``--warmup``,
  printed with a 95% interval of that median (order statistics) and the ratio of the two
  medians. The step is the same region in both: the train step through the loss on the host.
- **Wall time**: ``python -m hsdp_runner`` (defaults, ``logger=none``) and ``torchrun
  --standalone`` + ``benchmarks/minimal_fsdp.py`` as separate commands, ``--repeats`` pairs
  alternating which goes first (medians over the repeats); what the runner does around the
  steps (start-up checks, metrics, console, teardown) shows here. Each pair also prints the
  step-time ratio of the two separate commands and the 1-minute load average around it (two
  commands a minute apart are not the same machine: that figure is context, not the target).

The last line is ``step_time_ratio=<x> step_time_ci=<lo>-<hi> wall_ratio=<y>``: the worst layout
of each. Targets: step time <= 1.00 (both sides doing the same work), wall <= 1.15. Time it
alone: the 2-core machine shared with a test run measures the test run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.interleaved_steps import runner_overrides  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"fsdp": (2, 1), "fsdp_tp": (2, 2)}  # name -> (dp_shard, tp)


def _timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr[-3000:]}")
    return wall


def _env(world: int) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)),
    }
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(world: int, script: str, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        script,
        *flags,
    ]


def median_interval(values: list[float]) -> tuple[float, float]:
    """A 95% interval of the median of ``values`` from their order statistics (the normal
    approximation of the binomial): (low, high); the whole range when there are too few."""
    ranked = sorted(values)
    n = len(ranked)
    half = 0.98 * math.sqrt(n)
    low, high = math.floor(n / 2 - half), math.ceil(n / 2 + half)
    return ranked[max(low, 0)], ranked[min(high, n - 1)]


def interleaved(name: str, dp_shard: int, tp: int, args, tmp: Path) -> dict:
    """Step both loops in turn in one torchrun job (``interleaved_steps.py``); return the
    layout's paired step-time figures."""
    out = tmp / f"{name}_interleaved.json"
    cmd = _torchrun(
        dp_shard * tp,
        "benchmarks/interleaved_steps.py",
        f"--dp-shard={dp_shard}",
        f"--tp={tp}",
        f"--model={args.model}",
        f"--steps={args.steps}",
        f"--batch={args.batch}",
        f"--out={out}",
    )
    load_before = os.getloadavg()[0]
    _timed(cmd, _env(dp_shard * tp))
    times = json.loads(out.read_text())
    runner, minimal = times["runner"][args.warmup :], times["minimal"][args.warmup :]
    pairs = [r / m for r, m in zip(runner, minimal)]
    return {
        "runner_step": statistics.median(runner),
        "minimal_step": statistics.median(minimal),
        "ratio": statistics.median(pairs),
        "interval": median_interval(pairs),
        "load": (load_before, os.getloadavg()[0]),
    }


def run_pair(name: str, dp_shard: int, tp: int, args, tmp: Path, runner_first: bool) -> dict:
    """Run the runner and the minimal loop as separate commands for one layout; return their
    walls and step medians."""
    world = dp_shard * tp
    env = _env(world)
    out = tmp / f"{name}_minimal.json"
    minimal = _torchrun(
        world,
        "benchmarks/minimal_fsdp.py",
        f"--dp-shard={dp_shard}",
        f"--tp={tp}",
        f"--model={args.model}",
        f"--steps={args.wall_steps}",
        f"--batch={args.batch}",
        f"--out={out}",
    )
    job = tmp / f"{name}_runner_{time.monotonic_ns()}"
    runner = [
        sys.executable,
        "-m",
        "hsdp_runner",
        f"hydra.run.dir={job}",
        *runner_overrides(dp_shard, tp, args.model, args.wall_steps, args.batch),
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
        f"  {name} wall pair ({'runner' if runner_first else 'minimal'} first): wall runner "
        f"{wall_run:.1f} s, minimal {wall_min:.1f} s; step time as separate commands "
        f"{runner_step:.3f} / {minimal_step:.3f} s = {runner_step / minimal_step:.3f}; "
        f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return {
        "runner_wall": wall_run,
        "minimal_wall": wall_min,
        # what the wall time spends outside the timed steps: start-up, teardown, reporting
        "runner_outside": wall_run - sum(run_times),
        "minimal_outside": wall_min - sum(min_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=40, help="interleaved steps of each loop")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    parser.add_argument("--wall-steps", type=int, default=12, help="steps of each wall-time run")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument(
        "--repeats", type=int, default=3, help="wall-time pairs per layout (0: none)"
    )
    args = parser.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {platform.processor() or ''} "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; model={args.model} "
        f"interleaved steps={args.steps} (pairs after the first {args.warmup}) batch={args.batch}"
        f" wall repeats={args.repeats} of {args.wall_steps} steps"
    )
    step_ratios, intervals, wall_ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        for name in args.layouts.split(","):
            dp_shard, tp = LAYOUTS[name]
            steps = interleaved(name, dp_shard, tp, args, Path(tmp))
            step_ratios.append(steps["ratio"])
            intervals.append(steps["interval"])
            low, high = steps["interval"]
            print(
                f"{name:8s} (dp_shard={dp_shard}, tp={tp}): interleaved step time runner "
                f"{steps['runner_step']:.3f} s, minimal {steps['minimal_step']:.3f} s; ratio "
                f"{steps['ratio']:.3f} (95% interval {low:.3f}-{high:.3f}; of the medians "
                f"{steps['runner_step'] / steps['minimal_step']:.3f}); load "
                f"{steps['load'][0]:.1f} -> {steps['load'][1]:.1f}",
                flush=True,
            )
            if args.repeats == 0:
                continue
            runs = [
                run_pair(name, dp_shard, tp, args, Path(tmp), runner_first=i % 2 == 1)
                for i in range(args.repeats)
            ]
            r = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            wall_ratios.append(r["runner_wall"] / r["minimal_wall"])
            print(
                f"{name:8s} wall python -m hsdp_runner {r['runner_wall']:.1f} s, torchrun + "
                f"minimal {r['minimal_wall']:.1f} s, ratio {wall_ratios[-1]:.3f} | outside the "
                f"steps: runner {r['runner_outside']:.1f} s, minimal {r['minimal_outside']:.1f} s",
                flush=True,
            )
    worst = max(range(len(step_ratios)), key=step_ratios.__getitem__)
    low, high = intervals[worst]
    wall = f"{max(wall_ratios):.3f}" if wall_ratios else "n/a"
    print(
        f"step_time_ratio={step_ratios[worst]:.3f} step_time_ci={low:.3f}-{high:.3f} "
        f"wall_ratio={wall}"
    )


if __name__ == "__main__":
    main()
