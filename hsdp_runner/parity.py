"""``python -m hsdp_runner.parity``: prove every parallel layout trains the same model.

Runs the same config (seed, global batch, data, steps) under each layout through the runner's
own launch path, reads each job's metrics.jsonl and summary.json, and compares losses, grad
norms, the validation losses during training and the final eval loss against the
single-process run. Prints a table, writes
``parity.md``, and exits 1 if any layout is outside the tolerance or failed (2 on bad input,
128 + signal when a signal stopped it: the remaining layouts are not run). Without
``--layouts`` it checks every layout that runs without more arguments (``default_layouts``);
``--list`` prints that choice and exits without running anything.
"""

from __future__ import annotations

import argparse
import datetime
import math
import signal
import sys
from pathlib import Path

from omegaconf import DictConfig

from hsdp_runner.config.compose import CONF_DIR, to_run_config
from hsdp_runner.config.compose import compose as compose_config
from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.core.exit_codes import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from hsdp_runner.core.frozen_imports import freeze_imports
from hsdp_runner.core.records import RunInfo, RunSummary
from hsdp_runner.distributed.expert_layout import expert_refusal
from hsdp_runner.distributed.hardware import usable_gpus
from hsdp_runner.distributed.parallel_dims import DIM_NAMES
from hsdp_runner.models.base import model_spec, stage_blocks
from hsdp_runner.runtime.launch import run_job
from hsdp_runner.runtime.prelaunch import validate
from hsdp_runner.train import sinks

BASELINE = "single"
# A layout is a parallel preset, optionally with overrides after colons ("cp:parallel.cp=4").
ORDER = (
    "single",
    "ddp",
    "fsdp",
    "hsdp",
    "tp",
    "fsdp_tp",
    "hsdp_tp",
    "cp",
    "cp:parallel.cp=4",
    "cp:parallel.tp=2",
    "fsdp_cp",
    "hsdp_cp_tp",
    # Pipeline parallel: each schedule on 2 stages, 4 stages, then composed. The interleaved
    # ones and pp = 4 need at least 4 blocks: with the tiny models (2) they are skipped, with
    # PARITY_ARGS="model=llama3_tiny model.n_layers=4" (or llama3_debug) they run.
    "pp",
    "pp:parallel.pp_schedule=gpipe",
    "pp:parallel.pp_schedule=interleaved_1f1b:parallel.pp_stages_per_rank=2",
    "pp:parallel.pp_schedule=interleaved_zb:parallel.pp_stages_per_rank=2",
    "pp:parallel.pp=4",
    "pp_fsdp",
    "pp_fsdp_tp",
    "pp_hsdp",
    # Expert parallel (a model with experts: PARITY_ARGS=model=moe_tiny; a dense model skips
    # them): ep over all of dp_shard, over part of it, borrowing tp, with HSDP, borrowing cp,
    # under a pipeline, with activation checkpointing, gradient accumulation and compile.
    "fsdp:parallel.dp_shard=2:parallel.ep=2",
    "fsdp:parallel.ep=2",
    "fsdp:parallel.ep=4",
    "fsdp_tp:parallel.ep=2",
    "hsdp:parallel.ep=2",
    "cp:parallel.dp_shard=2:parallel.ep=2",
    "pp_fsdp:parallel.ep=2",
    "fsdp:parallel.ep=2:parallel.ac=full",
    "fsdp:parallel.ep=2:parallel.ac=selective",
    "fsdp:parallel.ep=2:parallel.ac=moe",
    "fsdp:parallel.ep=2:trainer.grad_accum_steps=2",
)
# Default tolerances (--rtol). On CPU every layout agrees with one process to ~2e-7 over 20
# steps (docs/layouts_and_parity.md). On GPU, cuBLAS picks its fp32 matmul kernels (tile shapes, split-K) per
# shape, and TP and sharding change the shapes, so sums run in another order; those
# differences grow over the steps. TF32 stays off (torch's default), which would add 1e-3.
CPU_RTOL = 1e-5
GPU_RTOL = 1e-4
GPU_RTOL_WHY = (
    "GPU default: cuBLAS picks different fp32 kernels for the TP/sharded matmul "
    "shapes, so sums run in another order"
)


def available_layouts() -> list[str]:
    """The standard layouts whose preset is in conf/parallel, then any preset added later."""
    names = {p.stem for p in (CONF_DIR / "parallel").glob("*.yaml")}
    return [n for n in ORDER if _preset(n) in names] + sorted(names - set(ORDER))


def _preset(layout: str) -> str:
    return layout.split(":")[0]


def compose(layout: str, overrides: list[str]) -> DictConfig:
    """Compose the app config for one layout (a preset and its own overrides, colon-separated)
    plus the shared overrides (Hydra compose API).

    Unless the overrides set ``launcher.nproc_per_node``, the layout runs on as many ranks as
    its degrees multiply to, on GPU too (where the default would be every GPU of the node,
    and ``single`` could not run on a multi-GPU node).
    """
    preset, *own = layout.split(":")
    cfg = compose_config(["logger=none", f"parallel={preset}", *own, *overrides])
    degrees = [cfg.parallel[name] for name in DIM_NAMES]
    if not any(o.startswith("launcher.nproc_per_node=") for o in overrides) and -1 not in degrees:
        cfg.launcher.nproc_per_node = math.prod(degrees) // cfg.launcher.nnodes
    return cfg


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the command line; raise ConfigError for a bad tolerance or layout name."""
    parser = argparse.ArgumentParser(prog="python -m hsdp_runner.parity", description=__doc__)
    parser.add_argument(
        "--layouts",
        default=None,
        help="comma-separated presets to check (default: every one that runs without more "
        "arguments; see --list)",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the layouts that would run (and those left out, and why), run nothing",
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument(
        "--rtol",
        default=None,
        help=f"max relative difference (default {CPU_RTOL:g} on CPU, {GPU_RTOL:g} on GPU)",
    )
    parser.add_argument("--out", default=None, help="output dir (default parity/<time>)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every layout")
    args = parser.parse_intermixed_args(argv)
    args.rtol_why = ""
    if args.rtol is None:
        on_gpu = "device=cpu" not in args.overrides and _cuda_available()
        args.rtol, args.rtol_why = (GPU_RTOL, GPU_RTOL_WHY) if on_gpu else (CPU_RTOL, "")
    try:
        args.rtol = float(args.rtol)
    except ValueError:
        raise ConfigError(f"--rtol={args.rtol!r} is not a number; use e.g. --rtol 1e-5") from None
    if not args.rtol > 0:
        raise ConfigError(f"--rtol={args.rtol} must be a positive number, e.g. --rtol 1e-5")
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps} must be >= 1")
    if args.layouts is not None:  # None: the default set, chosen in ``default_layouts``
        known = available_layouts()
        args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
        presets = {_preset(name) for name in known}
        unknown = [name for name in args.layouts if _preset(name) not in presets]
        if unknown:
            raise ConfigError(
                f"--layouts names unknown layout(s) {', '.join(unknown)}; choose from "
                f"{', '.join(known)}"
            )
        if BASELINE not in args.layouts:
            args.layouts.insert(0, BASELINE)
    args.out = Path(args.out or datetime.datetime.now().strftime("parity/%Y-%m-%d_%H-%M-%S"))
    return args


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(
    base: list[dict], other: list[dict], rtol: float, base_eval=None, other_eval=None
) -> dict:
    """Compare two runs' step records; return the differences and whether they pass ``rtol``."""
    if len(base) != len(other):
        return {"passed": False, "note": f"{len(other)} steps vs {len(base)}"}
    pairs = list(zip(base, other))
    if [("val_loss" in b) for b in base] != [("val_loss" in o) for o in other]:
        return {"passed": False, "note": "validated at other steps"}
    val = [(o["val_loss"], b["val_loss"]) for b, o in pairs if "val_loss" in b]
    row = {
        "max_abs_loss": max(abs(o["loss"] - b["loss"]) for b, o in pairs),
        "max_rel_loss": max(_rel(o["loss"], b["loss"]) for b, o in pairs),
        "max_rel_grad_norm": max(_rel(o["grad_norm"], b["grad_norm"]) for b, o in pairs),
        "max_rel_val_loss": max((_rel(o, b) for o, b in val), default=None),
        "rel_eval_loss": None if base_eval is None else _rel(other_eval, base_eval),
    }
    worst = max(v for k, v in row.items() if k.startswith(("max_rel", "rel_")) and v is not None)
    return {**row, "passed": worst <= rtol, "note": ""}


def format_table(rows: list[dict], rtol: float, why: str = "") -> str:
    """Render the parity rows as a markdown table (``why``: where the tolerance comes from)."""

    def fmt(value):
        return "-" if value is None else f"{value:.2e}"

    why = f"; {why}" if why else ""
    lines = [
        f"Parity against `{BASELINE}` (tolerance {rtol:.0e} relative{why})",
        "",
        "| layout | world size | max abs loss diff | max rel loss diff | max rel grad-norm "
        "diff | max rel val-loss diff | rel eval-loss diff | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        result = "PASS" if r["passed"] else f"FAIL {r['note']}".strip()
        if r.get("skipped"):
            result = f"SKIP {r['note']}"
        lines.append(
            f"| {r['layout']} | {r['world_size']} | {fmt(r.get('max_abs_loss'))} | "
            f"{fmt(r.get('max_rel_loss'))} | {fmt(r.get('max_rel_grad_norm'))} | "
            f"{fmt(r.get('max_rel_val_loss'))} | {fmt(r.get('rel_eval_loss'))} | {result} |"
        )
    return "\n".join(lines)


def unsupported_reason(cfg: RunConfig) -> str | None:
    """Why the model of ``cfg`` cannot run its layout (the family's own check, fewer blocks
    than the layout's pipeline stages: the tiny models have 2, or expert parallel on a dense
    model), or None."""
    refusal = expert_refusal(cfg.parallel.ep, cfg.model)
    if refusal:
        return refusal
    try:
        model_spec(cfg.model).check_parallel(
            cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel
        )
        if cfg.parallel.pp > 1:
            stage_blocks(
                cfg.model.n_layers,
                cfg.parallel.pp * cfg.parallel.pp_stages_per_rank,
                cfg.parallel.pp_first_stage_less_blocks,
                cfg.parallel.pp_last_stage_less_blocks,
            )
    except ConfigError as err:
        return str(err)
    return None


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides every layout's job gets: the steps, two eval batches and a validation of
    one held-out batch halfway and at the end, unless the command line says otherwise, then
    the command line's own."""
    overrides = [f"trainer.steps={args.steps}", *args.overrides]
    defaults = {
        "trainer.eval_batches": 2,
        "trainer.val_every": max(1, args.steps // 2),
        "trainer.val_batches": 1,
    }
    for key, value in defaults.items():
        if not any(o.startswith(f"{key}=") for o in overrides):
            overrides.append(f"{key}={value}")
    return overrides


def default_layouts(overrides: list[str]) -> tuple[dict[str, DictConfig], dict[str, str]]:
    """The set run without ``--layouts``: every layout of ``available_layouts`` whose world
    size is known without more arguments. A preset that leaves its degrees to the launch (-1:
    ``auto``) starts on launcher.nproc_per_node ranks or every GPU; on CPU without that
    override it could not start, so it is left out. Takes the jobs' overrides; returns
    ({layout: its composed config}, {layout left out: one line saying why and how to run it}).
    """
    chosen, left_out = {}, {}
    for layout in available_layouts():
        cfg = compose(layout, overrides)
        if cfg.launcher.nproc_per_node is None and not usable_gpus(cfg.device):
            left_out[layout] = (
                "its degrees are chosen at launch (-1), which on CPU needs a rank count; "
                f"run it with --layouts {layout}:launcher.nproc_per_node=4"
            )
        else:
            chosen[layout] = cfg
    return chosen, left_out


def choose_layouts(args: argparse.Namespace, overrides: list[str]):
    """Compose the layouts to check (``args.layouts``, or ``default_layouts`` when it is None)
    with ``overrides``; print a note for each layout left out of the default set. Returns
    ({layout: composed config}, {layout the model family cannot run: why}): such a layout is
    reported as skipped, not failed."""
    if args.layouts is None:
        configs, left_out = default_layouts(overrides)
        for layout, why in left_out.items():
            print(f"parity: left out {layout}: {why}", flush=True)
    else:
        configs = {layout: compose(layout, overrides) for layout in args.layouts}
    skipped = {}
    for layout, cfg in list(configs.items()):
        reason = unsupported_reason(to_run_config(cfg))
        if reason:
            skipped[layout] = reason
            del configs[layout]
    return configs, skipped


def list_layouts(args: argparse.Namespace) -> int:
    """``--list``: print the layouts a run with these arguments would check, each with its
    world size, and those it would skip or leave out; launch nothing. Returns 0."""
    configs, skipped = choose_layouts(args, job_overrides(args))
    for layout, cfg in configs.items():
        nproc = cfg.launcher.nproc_per_node or usable_gpus(cfg.device)
        print(f"parity: would run {layout} on {cfg.launcher.nnodes * nproc} rank(s)")
    for layout, why in skipped.items():
        print(f"parity: would skip {layout} (the model cannot run it: {why})")
    return EXIT_OK


def run_parity(args: argparse.Namespace) -> int:
    """Validate every layout first, then run them all and compare; return the exit code."""
    overrides = job_overrides(args)
    configs, skipped = choose_layouts(args, overrides)
    jobs = {}
    for layout, cfg in configs.items():
        out_dir = args.out / layout.replace(":", "+")
        jobs[layout] = (cfg, out_dir, validate(cfg, out_dir))
    codes = {}
    for layout, (cfg, out_dir, _) in jobs.items():
        print(f"parity: running {layout} -> {out_dir}", flush=True)
        codes[layout] = run_job(
            cfg,
            RunInfo(
                output_dir=str(out_dir),
                group=f"parity-{args.out.name}",
                run_name=layout,
                tags=[f"parallel={layout}", "parity"],
                multirun=True,
                overrides=overrides,
            ),
        )
        if codes[layout] > 128:  # Ctrl-C / SIGTERM: the whole parity run stops
            print(
                f"parity: stopped by a signal during {layout}; layouts not run: "
                f"{', '.join(list(jobs)[len(codes) :]) or 'none'}",
                file=sys.stderr,
            )
            return codes[layout]
    base_records = sinks.read_metrics(jobs[BASELINE][1])
    base_summary = RunSummary.read(jobs[BASELINE][1]) or RunSummary()
    rows = []
    for layout, (_, out_dir, dims) in jobs.items():
        summary = RunSummary.read(out_dir) or RunSummary()
        row = {"layout": layout, "world_size": dims.world_size}
        if codes[layout] != EXIT_OK or summary.status is not RunStatus.completed:
            row.update(
                passed=False,
                note=f"run failed (exit code {codes[layout]}): {summary.error or 'see its logs'}",
            )
        elif base_summary.status is not RunStatus.completed:
            row.update(passed=False, note=f"baseline {BASELINE} did not complete")
        else:
            row.update(
                compare(
                    base_records,
                    sinks.read_metrics(out_dir),
                    args.rtol,
                    base_summary.eval_loss,
                    summary.eval_loss,
                )
            )
        rows.append(row)
    rows += [
        {
            "layout": layout,
            "world_size": "-",
            "passed": True,
            "skipped": True,
            "note": f"(the model cannot run it: {why})",
        }
        for layout, why in skipped.items()
    ]
    table = format_table(rows, args.rtol, args.rtol_why)
    (args.out / "parity.md").write_text(table + "\n")
    print(table)
    print(f"parity: table written to {args.out / 'parity.md'}")
    return EXIT_OK if all(r["passed"] for r in rows) else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0 when every layout passes, 1 on a mismatch, 2 on bad input."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        return list_layouts(args) if args.list else run_parity(args)
    except ConfigError as err:
        print(f"hsdp_runner.parity: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:  # Ctrl-C between jobs (during a job the launcher handles it)
        print("hsdp_runner.parity: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
