"""The MoE block's experts in ``torch._grouped_mm`` against the per-expert loop, and a debug MoE
job's tokens/s at each expert-parallel degree, on this machine.

    .venv/bin/python benchmarks/moe.py [--part all|block|jobs] [--model moe_debug]
        [--batch 2] [--repeats 10] [--warmup 3]
        [--eps 1,2,4] [--world 4] [--steps 12] [--job-warmup 4] [--job-batch 8] [--set KEY=VALUE ...]

- **block**: one MoE block of the preset's shape (``conf/model/<model>.yaml``: router, routed
  experts, shared experts, auxiliary loss; training mode), on ``--batch`` sequences of the
  preset's length, built twice from the same weights: ``model.grouped_mm=true`` (three grouped
  matmuls over the experts) and ``false`` (the loop over experts, the reference). Forward +
  backward (into the input and every weight) of each, alternated, ``--repeats`` times after
  ``--warmup``; prints the median milliseconds of each, the loop's time over the grouped one's,
  the experts' counted GFLOP/s and the largest difference between the two outputs.
- **jobs**: ``python -m hsdp_runner model=<model> parallel=fsdp parallel.dp_shard=<world>
  parallel.ep=<ep>`` for each of ``--eps`` (same world, batch and steps: ep borrows ranks, it
  adds none), ``logger=none`` and the per-job meters off; prints per ep the median tokens/s
  (global and per rank) and step time over the steps after ``--job-warmup``, the last loss and
  the last step's busiest-expert-over-mean load (the same at every ep: the balance does not
  depend on the layout), and the 1-minute load average around each job.

Timing figures mean something only on a machine doing nothing else: run it alone (a shared
machine's load average, printed, says how far to trust them). The GPU side (the grouped
matmul's TFLOP/s, one MoE step's MFU) is ``benchmarks/moe_gpu.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hsdp_runner.models.moe import MoEConfig, TransformerBlock  # noqa: E402


def preset(name: str, **changes) -> MoEConfig:
    """The MoE preset ``conf/model/<name>.yaml`` as a MoEConfig (its keys, then ``changes``)."""
    fields = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())
    fields.pop("defaults", None)
    return MoEConfig(**{**fields, **changes})


def moe_blocks(cfg: MoEConfig, device: str = "cpu", dtype=torch.float32, seed: int = 0):
    """(grouped, loop): the MoE layer of one of ``cfg``'s MoE blocks, its weights drawn from
    N(0, init_std) with ``seed``, on ``device``, weights in ``dtype``, in training mode; the
    second a copy running the per-expert loop."""
    torch.manual_seed(seed)
    with torch.device(device):
        moe = TransformerBlock(cfg, dense=False).moe.train()
    with torch.no_grad():
        for param in moe.parameters():  # the buffers (expert bias, counts) stay fp32
            param.normal_(0.0, cfg.init_std)
            param.data = param.data.to(dtype)
    moe.experts.grouped_mm = True
    loop = copy.deepcopy(moe)
    loop.experts.grouped_mm = False
    return moe, loop


def expert_flops(cfg: MoEConfig, tokens: int) -> float:
    """FLOPs of the routed experts' forward + backward over ``tokens`` tokens: each of its
    ``top_k`` copies goes through three (dim x expert_ffn_dim) matmuls, 2 FLOPs per
    multiply-add, and backward costs twice the forward."""
    return 3 * tokens * cfg.top_k * 3 * 2 * cfg.dim * cfg.expert_ffn_dim


def _pass(moe, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One forward + backward of ``moe`` on ``x`` with output gradient ``grad`` (contiguous:
    the grouped matmul's backward needs it); returns (seconds, output)."""
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = moe(x)
    out.backward(grad)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    moe.zero_grad(set_to_none=True)
    x.grad = None
    return seconds, out.detach()


def block_figures(
    cfg: MoEConfig, batch: int, repeats: int, warmup: int, device: str = "cpu", dtype=None
) -> dict:
    """Time forward + backward of the grouped and the loop MoE block (``moe_blocks``) on
    ``batch`` sequences of ``cfg.seq_len`` random tokens, alternating, ``repeats`` after
    ``warmup``. Returns {grouped_ms, loop_ms, loop_over_grouped, grouped_gflops,
    max_abs_diff} (medians; FLOPs of the routed experts only, ``expert_flops``)."""
    dtype = dtype or torch.float32
    grouped, loop = moe_blocks(cfg, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (batch, cfg.seq_len, cfg.dim)
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    times = {"grouped": [], "loop": []}
    outputs = {}
    for _ in range(warmup + repeats):
        for name, moe in (("grouped", grouped), ("loop", loop)):
            seconds, outputs[name] = _pass(moe, x, grad)
            times[name].append(seconds)
    grouped_s = statistics.median(times["grouped"][warmup:])
    loop_s = statistics.median(times["loop"][warmup:])
    return {
        "grouped_ms": 1e3 * grouped_s,
        "loop_ms": 1e3 * loop_s,
        "loop_over_grouped": loop_s / grouped_s,
        "grouped_gflops": expert_flops(cfg, batch * cfg.seq_len) / grouped_s / 1e9,
        "max_abs_diff": (outputs["grouped"] - outputs["loop"]).abs().max().item(),
    }


def job_command(
    model: str, ep: int, world: int, steps: int, batch: int, out_dir: Path, extra=()
) -> list[str]:
    """The runner's command line of one ep job: FSDP over ``world`` ranks, ``ep`` of them
    sharing each MoE layer's experts, ``extra`` overrides last."""
    return [
        sys.executable,
        "-m",
        "hsdp_runner",
        f"hydra.run.dir={out_dir}",
        f"model={model}",
        "parallel=fsdp",
        f"parallel.dp_shard={world}",
        f"parallel.ep={ep}",
        f"trainer.steps={steps}",
        f"trainer.global_batch_size={batch}",
        "logger=none",
        "metrics.comm_step=null",
        "metrics.memory_steps=0",
        *extra,
    ]


def job_figures(out_dir: Path, warmup: int) -> dict:
    """A finished job's figures from its metrics.jsonl: medians over the steps after
    ``warmup`` of tokens/s (global, per rank) and step time; the last step's loss and
    busiest-expert-over-mean load."""
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    steady = records[warmup:] or records
    return {
        "tps_global": statistics.median(r["tps_global"] for r in steady),
        "tps_per_device": statistics.median(r["tps_per_device"] for r in steady),
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "loss": records[-1]["loss"],
        "load": records[-1].get("moe/load_max_over_mean"),
    }


def run_jobs(args) -> None:
    """Run and print one job per ep degree of ``args.eps`` (see the module docstring)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    print(
        f"jobs: model={args.model} parallel=fsdp dp_shard={args.world}, global batch "
        f"{args.job_batch}, {args.steps} steps (medians after {args.job_warmup})"
        + (f", {' '.join(args.set)}" if args.set else "")
    )
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        for ep in (int(e) for e in args.eps.split(",")):
            out = Path(tmp) / f"ep{ep}"
            cmd = job_command(args.model, ep, args.world, args.steps, args.job_batch, out, args.set)
            load = os.getloadavg()[0]
            result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"ep={ep} failed ({result.returncode}): {result.stderr[-3000:]}")
            f = job_figures(out, args.job_warmup)
            balance = "—" if f["load"] is None else f"{f['load']:.3f}"
            print(
                f"  ep={ep}: {f['tps_global']:,.0f} tok/s global, {f['tps_per_device']:,.0f} "
                f"per rank, step {f['step_time_s']:.3f} s, last loss {f['loss']:.4f}, expert "
                f"load max/mean {balance}; load {load:.1f} -> {os.getloadavg()[0]:.1f}",
                flush=True,
            )


def run_block(args) -> None:
    """Time and print the grouped against the loop MoE block (see the module docstring)."""
    cfg = preset(args.model, **dict(_typed(kv) for kv in args.set))
    f = block_figures(cfg, args.batch, args.repeats, args.warmup)
    print(
        f"block: {cfg.name} MoE layer (dim {cfg.dim}, {cfg.n_experts} experts of "
        f"{cfg.expert_ffn_dim}, top {cfg.top_k}, {cfg.n_shared_experts} shared), "
        f"{args.batch} x {cfg.seq_len} tokens, fp32, forward + backward, median of "
        f"{args.repeats} after {args.warmup}"
    )
    print(
        f"  grouped {f['grouped_ms']:.2f} ms ({f['grouped_gflops']:.2f} GFLOP/s in the experts), "
        f"loop {f['loop_ms']:.2f} ms: loop / grouped {f['loop_over_grouped']:.2f}; "
        f"outputs differ by at most {f['max_abs_diff']:.2e}",
        flush=True,
    )


def _typed(pair: str) -> tuple[str, object]:
    """``model.KEY=VALUE`` of ``--set`` as (KEY, VALUE parsed as YAML) for the block's config."""
    key, value = pair.split("=", 1)
    return key.removeprefix("model."), yaml.safe_load(value)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the parts it names; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "block", "jobs"), default="all")
    parser.add_argument("--model", default="moe_debug", help="a MoE preset of conf/model/")
    parser.add_argument("--batch", type=int, default=2, help="block: sequences per pass")
    parser.add_argument("--repeats", type=int, default=10, help="block: timed passes of each")
    parser.add_argument("--warmup", type=int, default=3, help="block: untimed passes first")
    parser.add_argument("--eps", default="1,2,4", help="jobs: expert-parallel degrees")
    parser.add_argument("--world", type=int, default=4, help="jobs: ranks (FSDP over all)")
    parser.add_argument("--steps", type=int, default=12, help="jobs: steps of each job")
    parser.add_argument("--job-warmup", type=int, default=4, help="jobs: steps left out")
    parser.add_argument("--job-batch", type=int, default=8, help="jobs: global batch")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="model.KEY=VALUE",
        help="model overrides for both parts, e.g. model.seq_len=128 for a smoke run",
    )
    args = parser.parse_args(argv)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, {torch.get_num_threads()} "
        "threads: figures are meaningful only on an otherwise idle machine"
    )
    if args.part in ("all", "block"):
        run_block(args)
    if args.part in ("all", "jobs"):
        run_jobs(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
