"""On one CUDA GPU: the same Llama 3 training job in torchtitan and in the runner, side by side.

Install torchtitan 0.2.2 and the wheels it needs that a torch image lacks (no network needed;
they are in .whl_titan/, see below), then run (the runner's own dependencies, Hydra, OmegaConf,
torchao, on PYTHONPATH as for any runner job):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/titan .whl_titan/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/torchtitan_pair.py --out "$OUT/torchtitan_pair.json"
        [--titan-site /tmp/titan] [--compile both|off|on] [--rounds 1] [--layers 16]
        [--seq-len 2048] [--batch 4] [--steps 20] [--warmup 3] [--timeout 240]
        [--titan-mp fsdp|amp]

Rows: eager and compiled (``--compile``); in each, the runner's job then torchtitan's, each a
fresh process, ``--rounds`` times over (alternating). Printed per row and written to ``--out``
as JSON: tokens/s per GPU, MFU and peak memory of each tool (medians of the steps after
``--warmup``; memory: the largest over all steps), with the ratios runner / torchtitan. A job
that fails or passes ``--timeout`` seconds is recorded with its error (the tail of its output),
printed and written, and the others still run. Without a CUDA GPU torch can use it says why and
exits 0 having run nothing. Exit code 0 when every job ran, 1 when one failed (or the two
parameter counts differ). Not yet timed on a GPU: the defaults (4 jobs of 20 steps) are
estimated at 2.5-4 minutes on an H100, most of it process start-up and the compiled jobs'
compilation; ``--compile off`` about a minute.

What is matched (the model: parameters counted by each tool, printed, must agree):
- shape: Llama 3.2 1B (width 2048, 16 blocks, 32 heads, 8 KV heads, SwiGLU 8192, vocabulary
  128,256, RoPE theta 500,000; untied output layer: 1,498,482,688 parameters), sequence
  ``--seq-len``, ``--batch`` sequences a step, synthetic token ids (no tokenizer, no dataset);
- precision: bf16 compute, fp32 master weights and AdamW state, fp32 gradient reduction, through
  FSDP2's ``MixedPrecisionPolicy`` on a one-rank mesh in both (the runner's ``parallel=single
  precision=bf16``; torchtitan with its own ``apply_fsdp``, see ``benchmarks/torchtitan_job.py``;
  ``--titan-mp amp`` instead runs stock one-GPU torchtitan: fp32 parameters under autocast);
- activation checkpointing, selective, op-level, per block, the same policy in both: torchtitan's
  ``selective_ac_option=op`` saves the outputs of every other ``aten.mm`` of a block (1st, 3rd,
  ...), of the SDPA kernels, ``aten.max`` and reduce-scatter, and recomputes the rest; the
  runner's ``parallel.ac=selective`` (``distributed/parallelize.selective_policy``) is that policy
  (every other mm/addmm, SDPA, max, TP/CP/EP collectives); RNG state not preserved in either;
- compile: each transformer block compiled with inductor (torchtitan ``compile.components=model``,
  so not its loss; the runner ``parallel.compile``), after AC wrapping, before FSDP;
- optimizer: fused AdamW, lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, 2 warm-up steps
  then cosine to 0.1 x, gradient clipping at norm 1; no checkpointing, validation, profiling,
  float8, TensorBoard or W&B; fp32 cross-entropy on the logits in both.

What differs:
- the model code (torchtitan's llama3: complex-number RoPE; the runner's ``models/llama.py``),
  the FSDP units (torchtitan wraps the embedding, each block, norm + output and the root; the
  runner each block and the root), the AdamW parameter groups (the runner excludes embedding and
  norms from weight decay), the data loader (torchtitan's ``StatefulDataLoader``);
- throughput: torchtitan's ``tps`` is tokens over the wall time between two step logs (the whole
  step: data, forward, backward, clip, optimizer, its logging); the runner's over its step time;
- MFU: each tool's own (FLOPs/token x tokens/s / its peak table): the same formula in both
  (6 x non-embedding params + 12 x layers x width x sequence) up to the norm weights, and the
  same peak for H100 SXM and H200 (989 TFLOP/s); the JSON holds each tool's FLOPs/token and peak;
- memory: the runner's ``mem_peak_gib`` is ``torch.cuda.max_memory_allocated``, compared with
  torchtitan's ``memory/max_active(GiB)`` (allocator's active bytes peak); both tools' reserved
  peaks are in the JSON too (torchtitan's console line shows only the reserved one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TITAN_JOB = REPO / "benchmarks" / "torchtitan_job.py"
TITAN_VERSION = "0.2.2"

# conf/model/llama3_1b.yaml's shape (width, heads, FFN, vocabulary, RoPE), blocks a flag.
SHAPE = {
    "dim": 2048,
    "heads": 32,
    "kv_heads": 8,
    "ffn_hidden": 8192,
    "vocab": 128256,
    "rope_theta": 500000.0,
}
LR, LR_WARMUP, MIN_LR_RATIO = 8e-4, 2, 0.1
TAIL_CHARS = 3000  # of a failed job's output, kept as its error

# torchtitan's console lines (components/metrics.py, train.py), colours off.
TITAN_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*\S+\s+"
    r"memory:\s*(?P<reserved>[\d.]+)GiB\([\d.]+%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%"
)
TITAN_SIZE = re.compile(r"size:\s*(?P<n>[\d,]+) total parameters")
TITAN_PEAK = re.compile(r"Peak FLOPS used for computing MFU:\s*(?P<peak>\S+)")


def runner_params(layers: int, seq_len: int) -> int:
    """Parameters of the runner's model of this shape (``models/llama.count_params``)."""
    from hsdp_runner.models.llama import LlamaConfig, count_params

    cfg = LlamaConfig(
        _target_="hsdp_runner.models.llama.LlamaConfig",
        name="llama3_1b",
        dim=SHAPE["dim"],
        n_layers=layers,
        n_heads=SHAPE["heads"],
        n_kv_heads=SHAPE["kv_heads"],
        vocab_size=SHAPE["vocab"],
        ffn_hidden_dim=SHAPE["ffn_hidden"],
        seq_len=seq_len,
        rope_theta=SHAPE["rope_theta"],
    )
    return count_params(cfg)["total"]


def runner_command(args, compiled: bool, out_dir: Path) -> list[str]:
    """The runner's one-GPU job of the row (see the module docstring)."""
    return [
        sys.executable,
        "-m",
        "hsdp_runner",
        f"hydra.run.dir={out_dir}",
        "model=llama3_1b",
        f"model.n_layers={args.layers}",
        f"model.seq_len={args.seq_len}",
        "parallel=single",
        "launcher.nproc_per_node=1",
        "precision=bf16",
        "device=cuda",
        "parallel.ac=selective",
        f"parallel.compile={str(compiled).lower()}",
        f"trainer.steps={args.steps}",
        f"trainer.global_batch_size={args.batch}",
        f"optim.lr={LR}",
        f"optim.warmup_steps={LR_WARMUP}",
        f"optim.min_lr_ratio={MIN_LR_RATIO}",
        f"metrics.warmup_steps={args.warmup}",
        "metrics.comm_step=null",  # counting collectives runs a step under a dispatch mode
        "metrics.memory_steps=0",  # and so does the tensor-memory measurement
        "logger=none",
    ] + (
        # The window ends two steps before the last, like torchtitan's (``titan_command``).
        [
            "profile.enable=true",
            f"profile.start_step={args.steps - 2}",
            "profile.steps=1",
        ]
        if args.profile
        else []
    )


def titan_command(args, compiled: bool, out_dir: Path) -> list[str]:
    """torchtitan's one-GPU job of the row through ``torchtitan_job.py`` under torchrun."""
    ours = [
        f"--metrics-jsonl={out_dir / 'metrics.jsonl'}",
        f"--mp={args.titan_mp}",
        f"--dim={SHAPE['dim']}",
        f"--layers={args.layers}",
        f"--heads={SHAPE['heads']}",
        f"--kv-heads={SHAPE['kv_heads']}",
        f"--ffn-hidden={SHAPE['ffn_hidden']}",
        f"--vocab={SHAPE['vocab']}",
        f"--rope-theta={SHAPE['rope_theta']}",
    ]
    titan = [
        f"--job.dump_folder={out_dir}",
        f"--training.steps={args.steps}",
        f"--training.local_batch_size={args.batch}",
        f"--training.seq_len={args.seq_len}",
        "--training.mixed_precision_param=bfloat16",
        "--training.mixed_precision_reduce=float32",
        "--training.max_norm=1.0",
        "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_ac_option=op",
        "--activation_checkpoint.no-preserve-rng-state",
        "--compile.components=model",
        f"--optimizer.lr={LR}",
        "--optimizer.implementation=fused",
        f"--lr_scheduler.warmup_steps={LR_WARMUP}",
        "--lr_scheduler.decay_type=cosine",
        f"--lr_scheduler.min_lr_factor={MIN_LR_RATIO}",
        "--metrics.log_freq=1",
        "--metrics.disable_color_printing",
    ] + (["--compile.enable"] if compiled else [])
    if args.profile:  # torchtitan traces the step at each multiple of profile_freq
        titan += [
            "--profiling.enable_profiling",
            "--profiling.save_traces_folder=profile",
            f"--profiling.profile_freq={args.steps - 2}",
        ]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return launcher + ["--nproc_per_node=1", str(TITAN_JOB), *ours, "--", *titan]


def titan_env(titan_site: str) -> dict:
    """This process's environment with ``titan_site`` (torchtitan and its wheels) first on
    PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (titan_site, env.get("PYTHONPATH")) if p)
    return env


def median_after(values: list, warmup: int):
    """Median of ``values`` after the first ``warmup`` (all of them when there are no more)."""
    kept = [v for v in (values[warmup:] or values) if v is not None]
    return statistics.median(kept) if kept else None


def titan_figures(out_dir: Path, log: str, warmup: int) -> dict:
    """torchtitan's job figures: from its per-step metrics (``metrics.jsonl``, written by
    ``torchtitan_job.py``), else from its console lines (reserved memory only)."""
    path = out_dir / "metrics.jsonl"
    records = []
    if path.exists():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if records:
        steps = {
            "tps": [r["throughput(tps)"] for r in records],
            "tflops": [r["tflops"] for r in records],
            "mfu": [r["mfu(%)"] / 100 for r in records],
            "loss": [r["loss_metrics/global_avg_loss"] for r in records],
        }
        active = max(r["memory/max_active(GiB)"] for r in records)
        reserved = max(r["memory/max_reserved(GiB)"] for r in records)
    else:
        lines = [m.groupdict() for m in TITAN_STEP.finditer(log)]
        if not lines:
            raise RuntimeError("no step metrics in torchtitan's output")
        steps = {
            "tps": [float(m["tps"].replace(",", "")) for m in lines],
            "tflops": [float(m["tflops"].replace(",", "")) for m in lines],
            "mfu": [float(m["mfu"]) / 100 for m in lines],
            "loss": [float(m["loss"]) for m in lines],
        }
        active, reserved = None, max(float(m["reserved"]) for m in lines)
    size, peak = TITAN_SIZE.search(log), TITAN_PEAK.search(log)
    tps, tflops = median_after(steps["tps"], warmup), median_after(steps["tflops"], warmup)
    return {
        "tps": tps,
        "mfu": median_after(steps["mfu"], warmup),
        "tflops": tflops,
        "mem_peak_gib": active,
        "mem_reserved_gib": reserved,
        "final_loss": steps["loss"][-1],
        "steps_logged": len(steps["tps"]),
        "params": int(size["n"].replace(",", "")) if size else None,
        "flops_per_token": tflops * 1e12 / tps if tps else None,
        "peak_tflops": float(peak["peak"]) / 1e12 if peak else None,
    }


def runner_figures(out_dir: Path) -> dict:
    """The runner's job figures from its summary.json."""
    from hsdp_runner.core.records import RunSummary

    s = RunSummary.read(out_dir)
    if s is None or s.median_tps_per_device is None:
        raise RuntimeError(f"no trained summary.json in {out_dir}")
    reserved = s.mem_reserved_gib_per_rank
    return {
        "tps": s.median_tps_per_device,
        "mfu": s.median_mfu,
        "tflops": s.median_tflops,
        "mem_peak_gib": s.mem_peak_gib,
        "mem_reserved_gib": max(reserved) if reserved else None,
        "final_loss": s.final_loss,
        "steps_logged": s.steps,
        "flops_per_token": s.flops_per_token,
        "peak_tflops": s.peak_tflops,
    }


def run_job(tool: str, cmd: list[str], env: dict, out_dir: Path, timeout: float, read) -> dict:
    """Run one job; its figures (``read(log)``), wall seconds and, on failure, ``error``."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
        log, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        log = "".join(
            s.decode(errors="replace") if isinstance(s, bytes) else (s or "")
            for s in (err.stdout, err.stderr)
        )
        rc = f"timed out after {timeout:g} s"
    wall = time.perf_counter() - start
    (out_dir / f"{tool}.log").write_text(log)
    result = {"wall_s": round(wall, 1)}
    if rc != 0:
        return {**result, "error": f"exit {rc}: {log[-TAIL_CHARS:]}"}
    try:
        return {**result, **read(log)}
    except Exception as err:  # a finished job whose figures cannot be read: recorded
        return {**result, "error": f"{type(err).__name__}: {err}; output: {log[-TAIL_CHARS:]}"}


def ratio(a, b):
    """``a / b`` or None."""
    return a / b if a is not None and b else None


def row_ratios(runner: dict, titan: dict) -> dict:
    """runner / torchtitan of tokens/s, MFU and peak memory (allocated vs active)."""
    return {k: ratio(runner.get(k), titan.get(k)) for k in ("tps", "mfu", "mem_peak_gib")}


def fmt(value, spec: str, scale: float = 1.0) -> str:
    """``value * scale`` formatted, or 'n/a'."""
    return "n/a" if value is None else format(value * scale, spec)


def print_row(row: dict) -> None:
    """One row: each tool's figures (or error) and the ratios."""
    print(f"== {row['name']} (round {row['round']})", flush=True)
    for tool in ("runner", "torchtitan"):
        r = row[tool]
        if "error" in r:
            print(f"  {tool:10s} FAILED after {r['wall_s']} s: {r['error'][-1500:]}", flush=True)
            continue
        print(
            f"  {tool:10s} {fmt(r['tps'], ',.0f')} tokens/s  MFU {fmt(r['mfu'], '.1f', 100)}%  "
            f"{fmt(r['tflops'], '.1f')} TFLOP/s  peak mem {fmt(r['mem_peak_gib'], '.2f')} GiB "
            f"(reserved {fmt(r['mem_reserved_gib'], '.2f')})  loss {fmt(r['final_loss'], '.3f')}"
            f"  [{r['wall_s']} s]",
            flush=True,
        )
    q = row["ratios"]
    print(
        f"  runner/torchtitan: tokens/s {fmt(q['tps'], '.3f')}  MFU {fmt(q['mfu'], '.3f')}  "
        f"peak mem {fmt(q['mem_peak_gib'], '.3f')}",
        flush=True,
    )


def run_rows(args, work: Path) -> list[dict]:
    """Every row, each round alternating the runner's job and torchtitan's."""
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]
    rows = []
    for compiled in modes:
        name = f"{'compiled' if compiled else 'eager'} bf16 selective-AC"
        for rnd in range(1, args.rounds + 1):
            row = {"name": name, "compile": compiled, "round": rnd}
            for tool in ("runner", "torchtitan"):
                out_dir = work / f"{'compiled' if compiled else 'eager'}_{rnd}_{tool}"
                out_dir.mkdir(parents=True)
                if tool == "runner":
                    cmd, env = runner_command(args, compiled, out_dir), dict(os.environ)
                    read = lambda log, d=out_dir: runner_figures(d)  # noqa: E731
                else:
                    cmd, env = titan_command(args, compiled, out_dir), titan_env(args.titan_site)
                    read = lambda log, d=out_dir: titan_figures(d, log, args.warmup)  # noqa: E731
                row[tool] = run_job(tool, cmd, env, out_dir, args.timeout, read)
            row["ratios"] = row_ratios(row["runner"], row["torchtitan"])
            print_row(row)
            rows.append(row)
    return rows


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the rows here as JSON")
    p.add_argument("--titan-site", default="/tmp/titan", help="torchtitan and its wheels")
    p.add_argument("--titan-mp", choices=("fsdp", "amp"), default="fsdp")
    p.add_argument("--compile", choices=("both", "off", "on"), default="both")
    p.add_argument("--rounds", type=int, default=1, help="alternations of the two tools")
    p.add_argument("--layers", type=int, default=16, help="transformer blocks")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per step (local = global)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per job")
    p.add_argument("--keep", type=Path, help="keep the jobs' folders (logs) here")
    p.add_argument(
        "--profile",
        action="store_true",
        help="trace one step of each job (step steps-2) and print both traces' GPU kernels "
        "side by side (benchmarks/trace_kernels.py)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the rows on the GPU; returns the exit code (see the module docstring)."""
    args = parse_args(argv)
    import torch

    from hsdp_runner.distributed.hardware import cuda_available, cuda_unusable_cause

    report = {"torchtitan_version": TITAN_VERSION, "torch": torch.__version__, "rows": []}
    if not cuda_available():
        why = cuda_unusable_cause() or "torch.cuda.is_available() is False"
        print(
            f"torchtitan_pair: no CUDA GPU torch can use here ({why}); this benchmark needs "
            "one: run it on a GPU node. Nothing was measured."
        )
        if args.out:
            args.out.write_text(json.dumps({**report, "skipped": why}, indent=2))
        return 0
    report["device"] = torch.cuda.get_device_name()
    report["params_runner"] = runner_params(args.layers, args.seq_len)
    report["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "keep")}
    print(
        f"# {report['device']}, torch {torch.__version__}, torchtitan {TITAN_VERSION}; "
        f"Llama 3 1B shape x {args.layers} blocks ({report['params_runner']:,} parameters), "
        f"seq {args.seq_len}, batch {args.batch}, {args.steps} steps (medians after "
        f"{args.warmup}); torchtitan precision: {args.titan_mp}",
        flush=True,
    )
    work = args.keep or Path(tempfile.mkdtemp(prefix="torchtitan-pair-"))
    report["rows"] = rows = run_rows(args, work)
    counts = {r["torchtitan"].get("params") for r in rows} - {None}
    report["params_torchtitan"] = counts.pop() if len(counts) == 1 else sorted(counts) or None
    same = report["params_torchtitan"] == report["params_runner"]
    print(
        f"parameters: runner {report['params_runner']:,}, torchtitan "
        f"{report['params_torchtitan']} ({'same' if same else 'DIFFERENT'})"
    )
    if args.profile:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from trace_kernels import compare_traces

        for row in rows:
            mode = "compiled" if row["compile"] else "eager"
            traces = {
                tool: sorted((work / f"{mode}_{row['round']}_{tool}").rglob("*trace.json*"))
                for tool in ("runner", "torchtitan")
            }
            if all(traces.values()):
                print(f"== kernels of one step, {row['name']} (round {row['round']})")
                report.setdefault("kernels", []).append(
                    compare_traces({t: paths[-1] for t, paths in traces.items()})
                )
            else:
                print(f"no trace for {[t for t, p in traces.items() if not p]}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.out}")
    failed = any("error" in r[t] for r in rows for t in ("runner", "torchtitan"))
    return 1 if failed or not same else 0


if __name__ == "__main__":
    sys.exit(main())
