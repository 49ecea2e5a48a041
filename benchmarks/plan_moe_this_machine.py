"""The planner against real sweeps of a mixture of experts on this machine, over ep layouts.

    python benchmarks/plan_moe_this_machine.py [--ranks 4 8] [--steps 8] [--top-k 8] [--out DIR]

Per rank count: ``python -m hsdp_runner.plan cluster=this_machine model=moe_tiny`` (cp 1; every
dp_replicate x dp_shard x tp x ep, the first plan on a machine measures it), the sweep of its
``--top-k`` best layouts it writes (``plan.write_sweep``), run with ``trainer.steps``, then
``benchmarks/plan_this_machine.figures``: Spearman's rank correlation of predicted vs measured
steady-state step time (target >= 0.8), whether the measured best is in the predicted top 2
(target yes), and per job the predicted memory per rank against the measured peak of tensor
memory (target: every job within 15%). Run it alone: the machine's 2 cores are what it times.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from plan_this_machine import _run, figures  # noqa: E402

MODEL = ["model=moe_tiny", "logger=none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    default_out = REPO / "benchmarks" / "out" / f"plan_moe_{stamp}"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    for ranks in args.ranks:
        out = args.out.resolve() / f"ranks_{ranks}"
        common = [*MODEL, f"trainer.steps={args.steps}"]
        _run(
            [
                "-m",
                "hsdp_runner.plan",
                "cluster=this_machine",
                f"cluster.gpus_per_node={ranks}",
                *common,
                "plan.cp_degrees=[1]",
                f"plan.top_k={args.top_k}",
                f"plan.out_dir={out / 'plan'}",
                f"plan.write_sweep={out / 'sweeps' / 'planned.yaml'}",
            ]
        )
        _run(
            [
                "-m",
                "hsdp_runner",
                "--config-dir",
                str(out / "sweeps"),
                "--config-name",
                "planned",
                f"hydra.sweep.dir={out / 'sweep'}",
            ]
        )
        figures(out / "sweep", out / "plan" / "plan.json", f"moe_tiny on {ranks} ranks")


if __name__ == "__main__":
    main()
