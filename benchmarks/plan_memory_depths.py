"""The planner's memory against the depth it measures at, and against a whole-model measurement.

    python benchmarks/plan_memory_depths.py [--quick] [--skip-whole] [--main PATH]

``plan.layers_measured`` should only trade planning time for accuracy. Per case (every model
preset, then long-sequence and large-vocabulary shapes with each activation checkpointing mode)
the plan of four layouts of its cluster (FSDP over every rank, HSDP with 2 replicas, FSDP x TP 2,
FSDP x CP 2; fewer where the model rules one out) is made with ``[1, 2]``, ``[2, 3]`` and
``[3, 4]``: printed per case are the largest spread over those layouts (max / min - 1, target
<= 5%), the FSDP layout's three peaks and the phase its peak falls in. Then, for 8 and 16-block
shapes, the prediction from ``[1, 2]`` against the tracker's measurement of the whole model (the
plan with ``layers_measured=[1, n]`` measures the model whole), per layout (target within 5%).
``--main PATH`` plans with the package at PATH instead (another checkout, for a before/after
table; a checkout that names no peak phase prints "-").

Measurements are cached per request in a temporary directory, so a depth measured for one
choice serves the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

if "--main" in sys.argv:
    sys.path.insert(0, sys.argv[sys.argv.index("--main") + 1])
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsdp_runner import plan  # noqa: E402
from hsdp_runner.config.compose import to_run_config  # noqa: E402
from hsdp_runner.core.errors import ConfigError  # noqa: E402
from hsdp_runner.distributed.hardware import CACHE_ENV  # noqa: E402
from hsdp_runner.planner.cluster import resolve  # noqa: E402
from hsdp_runner.planner.layouts import plan_layouts  # noqa: E402

TARGET = 0.05
DEPTHS = ([1, 2], [2, 3], [3, 4])
ONE_NODE = ["precision=bf16", "cluster=h100_sxm", "cluster.nodes=1"]
PRESETS = sorted(p.stem for p in (Path(plan.__file__).parents[1] / "conf" / "model").glob("*.yaml"))
LONG = [
    ["model=llama3_8b", "model.seq_len=8192", f"parallel.ac={ac}", "trainer.global_batch_size=16"]
    + ONE_NODE[:2]
    + ["cluster.nodes=2"]
    for ac in ("none", "selective", "full")
] + [
    [
        "model=llama3_8b",
        "model.vocab_size=32000",
        "model.seq_len=4096",
        "parallel.ac=none",
        "trainer.global_batch_size=128",
        "precision=bf16",
        "cluster=a100_80gb",
        "cluster.nodes=16",
    ],
    [
        "model=llama3_70b",
        "model.seq_len=8192",
        "parallel.ac=full",
        "trainer.global_batch_size=256",
        "precision=bf16",
        "cluster=h100_sxm",
        "cluster.nodes=32",
    ],
    ["model=llama3_1b", "model.seq_len=8192", "parallel.ac=selective"] + ONE_NODE,
    ["model=llama3_8b", "model.seq_len=4096", "trainer.grad_accum_steps=2"]
    + ["trainer.global_batch_size=16"]
    + ONE_NODE,
]
WHOLE = [
    ["model=llama3_8b", "model.n_layers=8", "model.vocab_size=32000", "model.seq_len=4096"]
    + [f"parallel.ac={ac}", "trainer.global_batch_size=16"]
    + ONE_NODE
    for ac in ("none", "selective", "full")
] + [
    ["model=llama3_1b", "model.seq_len=8192", "parallel.ac=full", "trainer.global_batch_size=8"]
    + ONE_NODE,
]


LAYOUTS = ["FSDP", "HSDP", "TP", "CP"]


def _rows(overrides: list[str]) -> dict[str, dict]:
    """The planned row of each of the case's ``LAYOUTS`` (those the model allows), by name."""
    cfg = plan.compose(overrides)
    cluster = resolve(to_run_config(cfg).cluster, cfg.precision.param_dtype)
    world = cluster.world_size
    layouts = {
        "FSDP": (1, world, 1, 1),
        "HSDP": (2, world // 2, 1, 1),
        "TP": (1, world // 2, 1, 2),
        "CP": (1, world // 2, 2, 1),
    }
    rows = {}
    for name, shape in layouts.items():
        if name not in LAYOUTS:
            continue
        fixed = dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), shape))
        try:
            row = plan_layouts(cfg, cluster, {}, fixed)[0]
        except ConfigError:
            continue
        if row["valid"]:
            rows[name] = row
    return rows


def _fsdp(rows: dict) -> str | None:
    return "FSDP" if "FSDP" in rows else None


def depths(cases: list[list[str]]) -> list[float]:
    """Print the [1,2]/[2,3]/[3,4] table; return each case's largest spread."""
    print(
        "| case | layouts | largest spread | FSDP [1,2] | [2,3] | [3,4] GiB | FSDP peak phase |\n"
        "|---|---|---|---|---|---|---|"
    )
    spreads = []
    for overrides in cases:
        plans = [_rows(overrides + [f"plan.layers_measured=[{a},{b}]"]) for a, b in DEPTHS]
        spread = max(
            max(p[k]["mem_gib"] for p in plans) / min(p[k]["mem_gib"] for p in plans) - 1
            for k in plans[0]
        )
        spreads.append(spread)
        fsdp = _fsdp(plans[0])
        mems = " | ".join(f"{p[fsdp]['mem_gib']:.1f}" for p in plans) if fsdp else "- | - | -"
        phase = plans[0][fsdp]["memory"].get("peak_phase", "-") if fsdp else "-"
        print(
            f"| `{' '.join(overrides)}` | {', '.join(plans[0])} | {spread:.1%} | {mems} | "
            f"{phase} |",
            flush=True,
        )
    return spreads


def whole(cases: list[list[str]]) -> list[float]:
    """Print the [1,2] prediction against the whole model measured; return the errors."""
    print(
        "\n| case (whole model measured) | layouts | largest |error| | FSDP [1,2] | FSDP whole "
        "| FSDP peak phase (whole) |\n|---|---|---|---|---|---|"
    )
    errors = []
    for overrides in cases:
        n = plan.compose(overrides).model.n_layers
        shallow = _rows(overrides + ["plan.layers_measured=[1,2]"])
        full = _rows(overrides + [f"plan.layers_measured=[1,{n}]"])
        error = max(abs(shallow[k]["mem_gib"] / full[k]["mem_gib"] - 1) for k in full)
        errors.append(error)
        fsdp = _fsdp(full)
        print(
            f"| `{' '.join(overrides)}` | {', '.join(full)} | {error:.1%} | "
            f"{shallow[fsdp]['mem_gib']:.2f} | {full[fsdp]['mem_gib']:.2f} | "
            f"{full[fsdp]['memory'].get('peak_phase', '-')} |",
            flush=True,
        )
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the presets only")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="e.g. FSDP,TP")
    parser.add_argument("--long", type=int, nargs="*", help="only these LONG cases (0-based)")
    parser.add_argument("--whole", type=int, nargs="*", help="only these WHOLE cases (0-based)")
    parser.add_argument("--skip-whole", action="store_true")
    parser.add_argument("--main", help="plan with the hsdp_runner package of this checkout")
    args = parser.parse_args()
    LAYOUTS[:] = args.layouts.split(",")
    long = [c for i, c in enumerate(LONG) if args.long is None or i in args.long]
    whole_cases = [c for i, c in enumerate(WHOLE) if args.whole is None or i in args.whole]
    with tempfile.TemporaryDirectory() as cache:
        os.environ[CACHE_ENV] = cache
        presets = [[f"model={m}", "trainer.global_batch_size=16"] + ONE_NODE for m in PRESETS]
        spreads = depths(presets + ([] if args.quick else long))
        print(
            f"\nlargest spread over [1,2]/[2,3]/[3,4]: {max(spreads):.1%} (target <= "
            f"{TARGET:.0%}: {'met' if max(spreads) <= TARGET else 'MISSED'})"
        )
        if not args.skip_whole:
            errors = whole(whole_cases)
            print(
                f"\nlargest |[1,2] / whole - 1|: {max(errors):.1%} (target <= {TARGET:.0%}: "
                f"{'met' if max(errors) <= TARGET else 'MISSED'})"
            )


if __name__ == "__main__":
    main()
