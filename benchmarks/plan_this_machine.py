"""The planner against a real sweep on this machine: plan -> degrees_8 sweep -> compare -> calibrate.

    python benchmarks/plan_this_machine.py [--out DIR] [--sweep-dir EXISTING_SWEEP] [--steps 8]

1. ``python -m hsdp_runner.plan cluster=this_machine model=llama3_debug`` (8 gloo ranks; the
   first plan on a machine measures it, ~20 s idle, cached after).
2. The ``degrees_8`` sweep (``trainer.steps``, ``logger=none``), unless ``--sweep-dir`` names a
   finished one.
3. ``compare --plan plan.json``: prints Spearman's rank correlation of predicted vs measured
   steady-state step time, whether the measured best is in the predicted top 2, and the median
   absolute error, against the targets (>= 0.8, yes, <= 25%); and per job the predicted memory
   per rank against the measured peak of tensor memory added since just before the model was
   built (``mem_tensor_peak_gib_per_rank``; target: every job within 15%).
4. ``--calibrate`` on the sweep, a new plan with the fitted file, and the same figures again:
   those are *fitted* to this sweep, not an independent check.
5. The independent check of a calibrated plan, the way it is meant to be used (calibrate once
   on a machine, then plan other work): the same sweep of another workload
   (``--calibration-args``, default ``model.seq_len=256``: half the compute and the TP
   traffic, the same data-parallel traffic), ``--calibrate`` on that one, then the plan of the
   first workload with its file, against the first sweep's measurements.
Timings on a shared, loaded machine are noisy; rerun on a quiet one for figures to quote.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsdp_runner import compare  # noqa: E402  (importable once REPO is on sys.path)
from hsdp_runner.report import prediction  # noqa: E402

COMMON = ["model=llama3_debug", "logger=none"]


def _run(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    print("$ " + " ".join(args), flush=True)
    subprocess.run([sys.executable] + args, cwd=REPO, env=env, check=False)


def figures(sweep: Path, plan_json: Path, title: str) -> None:
    """Print the ranking figures of ``sweep`` against ``plan_json`` and the targets."""
    jobs = compare.load_jobs(sweep)
    found = prediction.predictions_for([j.path for j in jobs], plan_json)
    pairs = [
        (j.label, found[j.path], j.summary.median_step_time_s)
        for j in jobs
        if j.path in found and j.status == "completed"
    ]
    fig = prediction.evaluate(pairs)
    summaries = {j.label: j.summary for j in jobs}
    mem = prediction.memory_figures(
        [
            (label, entry["mem_gib"], prediction.measured_memory_gib(summaries[label]))
            for label, entry, _ in pairs
        ]
    )
    print(
        f"\n## {title}\n\n| layout | predicted s | measured s | error | predicted mem GiB | "
        "measured mem GiB (tensor peak) | mem error |\n|---|---|---|---|---|---|---|"
    )
    rows = zip(pairs, fig["errors"], mem["errors"])
    for (label, entry, measured), error, mem_error in sorted(rows, key=lambda r: r[0][2]):
        measured_mem = prediction.measured_memory_gib(summaries[label])
        print(
            f"| {label} | {entry['step_time_s']:.3g} | {measured:.3g} | {error:+.0%} | "
            f"{entry['mem_gib']:.3f} | "
            f"{'n/a' if measured_mem is None else f'{measured_mem:.3f}'} | "
            f"{'n/a' if mem_error is None else f'{mem_error:+.0%}'} |"
        )
    rho, med = fig["spearman"], fig["median_abs_error"]
    print(
        f"\nSpearman {rho if rho is None else round(rho, 3)} (target >= 0.8); measured best in "
        f"predicted top 2: {fig['best_in_predicted_top2']} (target yes); median |error| "
        f"{med if med is None else f'{med:.0%}'} (target <= 25%); {fig['jobs']} jobs"
    )
    print(prediction.memory_summary(mem))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / f"plan_{stamp}")
    parser.add_argument("--sweep-dir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--calibration-args",
        default="model.seq_len=256",
        help="overrides of the other workload that step 5 calibrates on",
    )
    parser.add_argument(
        "--calibration-sweep-dir",
        type=Path,
        default=None,
        help="a finished sweep of that workload (skips running it)",
    )
    args = parser.parse_args()
    out = args.out.resolve()
    steps = [f"trainer.steps={args.steps}"]
    _run(
        [
            "-m",
            "hsdp_runner.plan",
            "cluster=this_machine",
            *COMMON,
            *steps,
            f"plan.out_dir={out / 'plan'}",
        ]
    )
    sweep = args.sweep_dir or out / "sweep"
    if args.sweep_dir is None:
        _run(
            [
                "-m",
                "hsdp_runner",
                "--config-dir",
                "sweeps",
                "--config-name",
                "degrees_8",
                *COMMON,
                *steps,
                f"hydra.sweep.dir={sweep}",
            ]
        )
    plan_json = out / "plan" / "plan.json"
    _run(["-m", "hsdp_runner.compare", str(sweep), "--plan", str(plan_json)])
    figures(sweep, plan_json, "Predicted (measured link table, default efficiency) vs measured")
    _run(["-m", "hsdp_runner.plan", "--calibrate", str(sweep), "--plan", str(plan_json)])
    written = sorted(sweep.glob("cluster_calibrated*.yaml"), key=lambda p: p.stat().st_mtime)
    if not written:
        print("no calibration was written (see the message above)")
        return
    fitted = written[-1]
    _run(
        [
            "-m",
            "hsdp_runner.plan",
            "cluster=this_machine",
            *COMMON,
            *steps,
            f"cluster.calibration={fitted}",
            f"plan.out_dir={out / 'plan_calibrated'}",
        ]
    )
    figures(
        sweep,
        out / "plan_calibrated" / "plan.json",
        "After --calibrate on this same sweep (fitted, not an independent check)",
    )
    print("\ncluster file:", json.dumps(fitted.read_text()))

    other = args.calibration_args.split()
    other_plan = out / "plan_other_workload"
    _run(
        [
            "-m",
            "hsdp_runner.plan",
            "cluster=this_machine",
            *COMMON,
            *steps,
            *other,
            f"plan.out_dir={other_plan}",
        ]
    )
    other_sweep = args.calibration_sweep_dir or out / "sweep_other_workload"
    if args.calibration_sweep_dir is None:
        _run(
            [
                "-m",
                "hsdp_runner",
                "--config-dir",
                "sweeps",
                "--config-name",
                "degrees_8",
                *COMMON,
                *steps,
                *other,
                f"hydra.sweep.dir={other_sweep}",
            ]
        )
    _run(
        [
            "-m",
            "hsdp_runner.plan",
            "--calibrate",
            str(other_sweep),
            "--plan",
            str(other_plan / "plan.json"),
        ]
    )
    written = sorted(other_sweep.glob("cluster_calibrated*.yaml"), key=lambda p: p.stat().st_mtime)
    if not written:
        print("no calibration was written for the other workload (see the message above)")
        return
    _run(
        [
            "-m",
            "hsdp_runner.plan",
            "cluster=this_machine",
            *COMMON,
            *steps,
            f"cluster.calibration={written[-1]}",
            f"plan.out_dir={out / 'plan_heldout'}",
        ]
    )
    figures(
        sweep,
        out / "plan_heldout" / "plan.json",
        f"Calibrated on another workload ({args.calibration_args}): an independent check",
    )


if __name__ == "__main__":
    main()
