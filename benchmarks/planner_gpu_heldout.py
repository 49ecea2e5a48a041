"""The planner on one GPU: predicted against measured step time and tensor memory for a spread
of single-GPU jobs; one job's step chooses sm90's compute_efficiency, the rest are held out.

    python benchmarks/planner_gpu_heldout.py plan [--cluster h200] [--dir benchmarks/out/gpu_plans]
    python benchmarks/planner_gpu_heldout.py run  [--dir benchmarks/out/gpu_plans] [--steps 16] [--only NAME ...]
        [--json PATH] [--timeout-s 150]
    python benchmarks/planner_gpu_heldout.py rescore --measured RUN.json [--cluster h200]
    python benchmarks/planner_gpu_heldout.py fit [--measured RUN.json] [--cluster h200]

``plan`` (no GPU needed; run it where you prepare): one ``python -m hsdp_runner.plan`` per job of
``JOBS`` with ``cluster=<--cluster> cluster.gpus_per_node=1``, writing ``<dir>/<name>/plan.json``.
``run`` (on the GPU): each job as ``python -m hsdp_runner ... plan.source=<its plan.json>``, so
its summary.json holds ``prediction`` (report/prediction.job_prediction: predicted and measured
steady-state step time, tokens/s/device, tensor memory per rank); prints the table and the
median absolute errors. Without a CUDA GPU ``run`` says why and exits 0. A job that fails is a
row with its error; the others still run. ``rescore`` (no GPU): plans every job of a ``run``'s
JSON again with the planner as it is now and prints its predictions against that run's
measurements (the table of docs/planner.md, after a change to the planner). ``fit`` (no GPU):
the ``compute_efficiency`` at which the ``FITTED`` job's predicted step equals its measured one
in RUN.json (default ``MEASURED``): sm90's constant (presets ``h100_sxm`` and ``h200``).

The jobs (``JOBS``) cover the single-GPU axes the planner prices: Llama-3 1B without AC,
with selective AC and compile, with float8 (compiled, tensorwise) and full AC; Llama-3 8B cut
to 8 blocks (its full vocabulary) with full AC; GPT-2 small; the Qwen3-30B-A3B preset cut to 2
blocks (experts, grouped matmuls). One is fitted: ``FITTED``, the plainest (eager bf16, no
AC), chooses sm90's ``compute_efficiency`` (``fit``); the other five are held out, and so is
every published figure of ``benchmarks/published_figures.yaml`` on an sm90 preset.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsdp_runner import plan  # noqa: E402
from hsdp_runner.config.compose import to_run_config  # noqa: E402
from hsdp_runner.core.errors import ConfigError  # noqa: E402
from hsdp_runner.core.records import RunSummary  # noqa: E402
from hsdp_runner.distributed.hardware import cuda_available, cuda_unusable_cause  # noqa: E402
from hsdp_runner.planner.cluster import resolve  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from plan_published import efficiency_matching  # noqa: E402

JOBS = {  # in the order run: a lease cut short keeps the first
    "llama1b_bf16_ac_none": ["model=llama3_1b", "precision=bf16", "trainer.global_batch_size=4"],
    "qwen3moe_2blocks_bf16": [
        "model=qwen3_30b_a3b",
        "model.n_layers=2",
        "model.seq_len=2048",
        "precision=bf16",
        "trainer.global_batch_size=4",
    ],
    "llama8b_8blocks_bf16_full": [
        "model=llama3_8b",
        "model.n_layers=8",
        "precision=bf16",
        "trainer.global_batch_size=4",
        "parallel.ac=full",
    ],
    "gpt2small_bf16": ["model=gpt2_small", "precision=bf16", "trainer.global_batch_size=16"],
    "llama1b_bf16_sel_compile": [
        "model=llama3_1b",
        "precision=bf16",
        "trainer.global_batch_size=4",
        "parallel.ac=selective",
        "parallel.compile=true",
    ],
    "llama1b_float8_full_compile": [
        "model=llama3_1b",
        "precision=float8",
        "trainer.global_batch_size=8",
        "parallel.ac=full",
        "parallel.compile=true",
    ],
}
COMMON = ["parallel=single"]
# The H200 run of JOBS the fit reads (torch 2.11.0+cu130; docs/planner.md, "Held out on one
# H200"), and its job that chooses sm90's compute_efficiency: the planner predicts this
# runner's step, so the constant comes from this runner's plainest job on today's software
# rather than from a published run of older software.
MEASURED = REPO / "benchmarks" / "results" / "h200_2026-11-27" / "heldout.json"
FITTED = "llama1b_bf16_ac_none"


def plan_all(args) -> int:
    """Write every job's plan.json under ``args.dir``; 1 if one failed."""
    failed = 0
    for name, overrides in JOBS.items():
        out = args.dir / name
        cmd = [sys.executable, "-m", "hsdp_runner.plan", *COMMON, *overrides]
        cmd += [f"cluster={args.cluster}", "cluster.gpus_per_node=1", f"plan.out_dir={out}"]
        print("$", " ".join(cmd[2:]), flush=True)
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if result.returncode:
            failed = 1
            print(result.stdout[-2000:], result.stderr[-2000:])
        else:
            print("\n".join(result.stdout.splitlines()[-3:]))
    return failed


def run_job(name: str, args) -> dict:
    """Run job ``name`` against its plan; its summary's prediction (or the error)."""
    source = (args.dir / name / "plan.json").resolve()
    with tempfile.TemporaryDirectory(prefix=f"heldout-{name}-") as tmp:
        cmd = [sys.executable, "-m", "hsdp_runner", f"hydra.run.dir={tmp}", *COMMON, *JOBS[name]]
        cmd += [
            "launcher.nproc_per_node=1",
            "device=cuda",
            f"trainer.steps={args.steps}",
            "logger=none",
            f"plan.source={source}",
        ]
        print("$", " ".join(cmd[2:]), flush=True)
        env = {**os.environ, "WANDB_MODE": "disabled"}
        try:
            result = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout_s
            )
        except subprocess.TimeoutExpired:
            return {"job": name, "error": f"timed out after {args.timeout_s} s"}
        if result.returncode:
            return {"job": name, "error": (result.stdout + result.stderr)[-3000:]}
        summary = RunSummary.read(Path(tmp))
        row = {"job": name, "prediction": summary.prediction}
        row["mfu"] = getattr(summary, "median_mfu", None)
        row["mem_reserved_gib"] = getattr(summary, "mem_peak_gib_per_rank", None)
        return row


def run_all(args) -> int:
    """Run the jobs on this GPU and print predicted against measured (module docstring)."""
    if not cuda_available():
        print(f"no CUDA GPU torch can use ({cuda_unusable_cause()}): nothing run")
        return 0
    rows, failed = [], 0
    for name in args.only or list(JOBS):
        row = run_job(name, args)
        rows.append(row)
        if "error" in row or not row.get("prediction"):
            failed = 1
            print(f"{name}: FAILED {row.get('error', 'no prediction in summary.json')}", flush=True)
            continue
        p = row["prediction"]["figures"]
        cells = [
            f"{key} pred {p[key]['predicted']:.4g} meas {p[key]['measured']:.4g} "
            f"({p[key]['error']:+.1%})"
            for key in ("step_time_s", "mem_gib")
            if p.get(key) and p[key].get("measured")
        ]
        print(f"{name}: " + "; ".join(cells), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1, default=str))
    predicted_table([r for r in rows if r.get("prediction")])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return failed


def predicted_table(rows: list[dict]) -> None:
    """Print each row's predicted and measured step time and memory, and the median |error|
    of the held-out jobs (the step time of ``FITTED`` chose the constant; its memory did not)."""
    for key in ("step_time_s", "mem_gib"):
        errors = []
        for row in rows:
            figure = (row.get("prediction") or {}).get("figures", {}).get(key)
            if figure and figure.get("error") is not None:
                fitted = key == "step_time_s" and row["job"] == FITTED
                if not fitted:
                    errors.append(abs(figure["error"]))
                print(
                    f"{row['job']:30s} {key} predicted {figure['predicted']:.4g} measured "
                    f"{figure['measured']:.4g} ({figure['error']:+.1%})"
                    + (" fitted" if fitted else "")
                )
        if errors:
            print(
                f"{key}: median |error| {statistics.median(errors):.1%} over {len(errors)} "
                "held-out jobs"
            )


def rescore(args) -> int:
    """Plan the jobs of ``args.measured`` anew; print the new predictions against its
    measurements. 1 if a plan failed."""
    measured = json.loads(args.measured.read_text())
    with tempfile.TemporaryDirectory(prefix="rescore-") as tmp:
        args.dir = Path(tmp)
        failed = plan_all(args)
        rows = []
        for row in measured:
            figures = (row.get("prediction") or {}).get("figures")
            plan_file = args.dir / row["job"] / "plan.json"
            if not figures or not plan_file.is_file():
                continue
            entry = json.loads(plan_file.read_text())["layouts"][0]
            new = {}
            for key, figure in figures.items():
                measured_value = figure["measured"]
                new[key] = {
                    "predicted": entry[key],
                    "measured": measured_value,
                    "error": entry[key] / measured_value - 1 if measured_value else None,
                }
            rows.append({"job": row["job"], "prediction": {"figures": new}})
    predicted_table(rows)
    return failed


def predicted_step_s(name: str, cluster: str, efficiency: float | None = None) -> float:
    """The planned step time of job ``name`` on one GPU of ``cluster`` (the row ``plan``
    writes), at ``efficiency`` if given, else the preset's ``compute_efficiency``."""
    overrides = [*COMMON, *JOBS[name], f"cluster={cluster}", "cluster.gpus_per_node=1"]
    if efficiency is not None:
        overrides.append(f"cluster.compute_efficiency={efficiency!r}")
    _, entries = plan.predict(plan.compose(overrides), {})
    return entries[0]["step_time_s"]


def measured_step_s(measured: Path, name: str) -> float:
    """The measured steady-state step time of job ``name`` in a ``run``'s JSON."""
    for row in json.loads(measured.read_text()):
        if row["job"] == name:
            figure = ((row.get("prediction") or {}).get("figures") or {}).get("step_time_s")
            if figure and figure.get("measured"):
                return figure["measured"]
    raise ConfigError(f"{measured}: no measured step time of job {name}")


def fit_efficiency(
    measured: Path = MEASURED, name: str = FITTED, cluster: str = "h200", rel_tol: float = 1e-4
) -> float:
    """The ``compute_efficiency`` at which job ``name``'s predicted step equals its measured
    step in ``measured``, to ``rel_tol`` (``plan_published.efficiency_matching``)."""
    target = measured_step_s(measured, name)
    try:
        return efficiency_matching(
            lambda e: predicted_step_s(name, cluster, e), target, rel_tol=rel_tol
        )
    except ConfigError as err:
        raise ConfigError(f"job {name} on cluster {cluster}: {err}") from None


def fit(args) -> int:
    """Print the fitted ``compute_efficiency`` beside the preset's."""
    efficiency = fit_efficiency(args.measured or MEASURED, FITTED, args.cluster)
    preset = resolve(to_run_config(plan.compose([f"cluster={args.cluster}"])).cluster, "bfloat16")
    print(
        f"{FITTED}: compute_efficiency fitted to its measured step = {efficiency:.4f} "
        f"(preset conf/cluster/{args.cluster}.yaml: {preset.compute_efficiency:g})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``plan``, ``run``, ``rescore`` or ``fit`` (module docstring); the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["plan", "run", "rescore", "fit"])
    parser.add_argument(
        "--measured", type=Path, help="rescore, fit: a run's --json output (fit: MEASURED)"
    )
    parser.add_argument("--cluster", default="h200")
    parser.add_argument("--dir", type=Path, default=REPO / "benchmarks" / "out" / "gpu_plans")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--only", nargs="*", choices=list(JOBS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--timeout-s", type=int, default=150)
    args = parser.parse_args(argv)
    if args.action == "rescore":
        if not args.measured:
            parser.error("rescore needs --measured RUN.json")
        return rescore(args)
    if args.action == "fit":
        return fit(args)
    return plan_all(args) if args.action == "plan" else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
