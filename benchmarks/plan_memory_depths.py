"""The planner's memory against the depth it measures at, and against a whole-model measurement.

    python benchmarks/plan_memory_depths.py [--quick] [--skip-whole]

``plan.layers_measured`` should only trade planning time for accuracy. Per case (every model
preset, then long-sequence and large-vocabulary shapes with each activation checkpointing mode;
every layout the planner enumerates: FSDP, HSDP, DDP, TP, CP and their mixes) the plan is made
with ``[1, 2]``, ``[2, 3]`` and ``[3, 4]`` and every valid layout's predicted peak compared:
printed per case are the largest spread over layouts (max / min - 1, target <= 5%), the FSDP
layout's three peaks and the phase its peak falls in. Then, for 8 and 16-block shapes, the
prediction from ``[1, 2]`` against the tracker's measurement of the whole model (the plan with
``layers_measured=[1, n]`` measures the model whole), per layout (target within 5%).

Measurements are cached per request in a temporary directory, so a depth measured for one
choice serves the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsdp_runner import plan  # noqa: E402
from hsdp_runner.distributed.hardware import CACHE_ENV  # noqa: E402

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


def _rows(overrides: list[str]) -> dict[tuple, dict]:
    """Valid layouts of one plan: degrees and axes -> row."""
    _, entries = plan.predict(plan.compose(overrides), {})
    return {tuple(sorted(e["overrides"].items())): e for e in entries if e["valid"]}


def _fsdp(rows: dict) -> tuple | None:
    for key in rows:
        o = dict(key)
        if o["parallel.dp_replicate"] == o["parallel.cp"] == o["parallel.tp"] == 1:
            return key
    return None


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
            f"| `{' '.join(overrides)}` | {len(plans[0])} | {spread:.1%} | {mems} | {phase} |",
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
            f"| `{' '.join(overrides)}` | {len(full)} | {error:.1%} | "
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
    parser.add_argument("--skip-whole", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ[CACHE_ENV] = cache
        presets = [[f"model={m}", "trainer.global_batch_size=16"] + ONE_NODE for m in PRESETS]
        spreads = depths(presets + ([] if args.quick else LONG))
        print(
            f"\nlargest spread over [1,2]/[2,3]/[3,4]: {max(spreads):.1%} (target <= "
            f"{TARGET:.0%}: {'met' if max(spreads) <= TARGET else 'MISSED'})"
        )
        if not args.skip_whole:
            errors = whole(WHOLE)
            print(
                f"\nlargest |[1,2] / whole - 1|: {max(errors):.1%} (target <= {TARGET:.0%}: "
                f"{'met' if max(errors) <= TARGET else 'MISSED'})"
            )


if __name__ == "__main__":
    main()
