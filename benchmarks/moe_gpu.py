"""On a CUDA GPU: the experts' grouped matmul in TFLOP/s, and one MoE training step's MFU.

    .venv/bin/python benchmarks/moe_gpu.py [--model qwen3_30b_a3b] [--tokens 8192]
        [--repeats 20] [--warmup 5] [--layers 2] [--batch 4] [--seq-len 2048] [--steps 12]
        [--step-warmup 4] [--part all|matmul|step]

Without a CUDA GPU torch can use it says so, with the cause (a CPU build, hidden GPUs, a driver
older than the wheel's CUDA), and exits 0 having run nothing.

- **matmul**: the preset's routed experts (``conf/model/<model>.yaml``: n_experts SwiGLU
  experts of dim x expert_ffn_dim) in bf16 on ``--tokens`` tokens, each routed to top_k
  experts drawn at random (about even loads, as a balanced router gives): the forward's three
  ``torch._grouped_mm`` calls alone, then the experts' forward + backward as the model runs
  them (``GroupedExperts``), each against the per-expert loop. TFLOP/s = the counted FLOPs (2
  per multiply-add; backward twice the forward) over the median time of ``--repeats`` calls
  after ``--warmup``, and as a share of the GPU's dense bf16 peak (the runner's table,
  ``train/metrics.PEAK_TFLOPS``; unknown GPU: no share).
- **step**: ``python -m hsdp_runner model=<model> model.n_layers=<layers> model.seq_len=<seq>
  parallel=single launcher.nproc_per_node=1 precision=bf16 device=cuda`` for ``--steps``
  steps of ``--batch`` sequences; prints the job's medians after ``--step-warmup`` steps from
  its summary.json: tokens/s, TFLOP/s and MFU (the runner's: FLOPs of the active parameters,
  the routed top_k and shared experts, over the peak) and peak memory. qwen3_30b_a3b with 2
  blocks holds ~1.8B parameters (the 151,936-token embedding and output layer are a third):
  ~30 GB of weights, gradients and AdamW state with fp32 masters, plus the activations.

Exit code 0 when every part ran (or there is no GPU), 1 when one failed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import REPO, moe_blocks, preset  # noqa: E402  (benchmarks/moe.py)

from hsdp_runner.core.records import RunSummary  # noqa: E402
from hsdp_runner.distributed.hardware import cuda_available, cuda_unusable_cause  # noqa: E402
from hsdp_runner.models.moe import MoEConfig  # noqa: E402
from hsdp_runner.train.metrics import lookup_peak_tflops  # noqa: E402


def routed_counts(cfg: MoEConfig, tokens: int, device: str, seed: int = 0) -> torch.Tensor:
    """(n_experts,) int64 copies per expert of ``tokens`` tokens, each sent to ``top_k``
    distinct experts drawn uniformly at random."""
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.rand(tokens, cfg.n_experts, generator=gen).topk(cfg.top_k, dim=1).indices
    return torch.bincount(chosen.flatten(), minlength=cfg.n_experts).to(device)


def timed(fn, repeats: int, warmup: int, device: str) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` (synchronised)."""
    times = []
    for i in range(warmup + repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_figures(
    cfg: MoEConfig, tokens: int, repeats: int, warmup: int, device: str = "cuda", dtype=None
) -> dict:
    """{case: (TFLOP/s, seconds)} of the experts' forward matmuls alone (``grouped forward``,
    ``loop forward``) and of their forward + backward (``grouped fwd+bwd``, ``loop fwd+bwd``)
    on ``tokens`` tokens routed by ``routed_counts``, in ``dtype`` (bf16 by default)."""
    dtype = dtype or torch.bfloat16
    grouped, loop = (m.experts for m in moe_blocks(cfg, device, dtype))
    counts = routed_counts(cfg, tokens, device)
    rows = int(counts.sum())
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, cfg.dim, generator=gen, device=device, dtype=dtype)
    grad = torch.randn(rows, cfg.dim, generator=gen, device=device, dtype=dtype)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    w1, w2, w3 = (w.detach() for w in (grouped.w1, grouped.w2, grouped.w3))

    def grouped_forward():
        hidden = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        hidden = hidden * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offs)

    def forward_backward(experts):
        def run():
            x.requires_grad_(True)
            experts(x, counts).backward(grad)
            experts.zero_grad(set_to_none=True)
            x.grad = None

        return run

    forward_flops = rows * 3 * 2 * cfg.dim * cfg.expert_ffn_dim
    cases = {
        "grouped forward": (grouped_forward, forward_flops),
        "loop forward": (lambda: loop(x.detach(), counts), forward_flops),
        "grouped fwd+bwd": (forward_backward(grouped), 3 * forward_flops),
        "loop fwd+bwd": (forward_backward(loop), 3 * forward_flops),
    }
    figures = {}
    for name, (fn, flops) in cases.items():
        with torch.set_grad_enabled(name.endswith("fwd+bwd")):
            seconds = timed(fn, repeats, warmup, device)
        figures[name] = (flops / seconds / 1e12, seconds)
    return figures


def step_command(args, out_dir: Path) -> list[str]:
    """The runner's command line of the one-GPU MoE step job (see the module docstring)."""
    return [
        sys.executable,
        "-m",
        "hsdp_runner",
        f"hydra.run.dir={out_dir}",
        f"model={args.model}",
        f"model.n_layers={args.layers}",
        f"model.seq_len={args.seq_len}",
        "parallel=single",
        "launcher.nproc_per_node=1",
        "precision=bf16",
        "device=cuda",
        f"trainer.steps={args.steps}",
        f"trainer.global_batch_size={args.batch}",
        f"metrics.warmup_steps={args.step_warmup}",
        "logger=none",
    ]


def run_matmul(args, name: str) -> None:
    """Print ``matmul_figures`` of ``args.model``'s experts on this GPU."""
    cfg = preset(args.model)
    peak = lookup_peak_tflops(name, "bfloat16")
    print(
        f"grouped matmul: {cfg.name} experts ({cfg.n_experts} of {cfg.dim} x "
        f"{cfg.expert_ffn_dim}, top {cfg.top_k}), {args.tokens} tokens, bf16, median of "
        f"{args.repeats} after {args.warmup}; dense bf16 peak "
        + (f"{peak:g} TFLOP/s" if peak else "unknown for this GPU")
    )
    for case, (tflops, seconds) in matmul_figures(
        cfg, args.tokens, args.repeats, args.warmup
    ).items():
        share = f" ({100 * tflops / peak:.1f}% of peak)" if peak else ""
        print(f"  {case:16s} {tflops:8.1f} TFLOP/s{share}  {1e3 * seconds:.3f} ms", flush=True)


def run_step(args) -> None:
    """Run the one-GPU MoE step job and print its figures; raises on a failed job."""
    with tempfile.TemporaryDirectory(prefix="moe-gpu-") as tmp:
        cmd = step_command(args, Path(tmp))
        print("one MoE step:", " ".join(cmd[3:]), flush=True)
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the job failed ({result.returncode}): {result.stderr[-3000:]}")
        s = RunSummary.read(tmp)
    mfu = "n/a (unknown peak)" if s.median_mfu is None else f"{100 * s.median_mfu:.1f}%"
    print(
        f"  {s.median_tps_global:,.0f} tokens/s, {s.median_tflops:.1f} TFLOP/s, MFU {mfu} "
        f"(active parameters, {s.flops_per_token:.3g} FLOPs/token), step "
        f"{s.median_step_time_s:.3f} s, peak memory {s.mem_peak_gib:.1f} GiB (medians after "
        f"{s.warmup_steps_excluded} steps)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the parts on the GPU; returns the exit code (see the docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "matmul", "step"), default="all")
    parser.add_argument("--model", default="qwen3_30b_a3b", help="a MoE preset of conf/model/")
    parser.add_argument("--tokens", type=int, default=8192, help="matmul: tokens routed")
    parser.add_argument("--repeats", type=int, default=20, help="matmul: timed calls")
    parser.add_argument("--warmup", type=int, default=5, help="matmul: untimed calls first")
    parser.add_argument("--layers", type=int, default=2, help="step: the preset's blocks kept")
    parser.add_argument("--batch", type=int, default=4, help="step: sequences per step")
    parser.add_argument("--seq-len", type=int, default=2048, help="step: tokens per sequence")
    parser.add_argument("--steps", type=int, default=12, help="step: steps of the job")
    parser.add_argument("--step-warmup", type=int, default=4, help="step: steps left out")
    args = parser.parse_args(argv)
    if not cuda_available():
        print(
            "moe_gpu: no CUDA GPU torch can use here "
            f"({cuda_unusable_cause() or 'torch.cuda.is_available() is False'}); "
            "this check needs one: run it on a GPU node. Nothing was measured."
        )
        return 0
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    print(f"# {name} (compute capability {major}.{minor}), torch {torch.__version__}")
    failed = False
    parts = {"matmul": lambda: run_matmul(args, name), "step": lambda: run_step(args)}
    for part, run in parts.items():
        if args.part not in ("all", part):
            continue
        try:
            run()
        except Exception as err:  # report the part and go on: the other may still run
            print(f"{part} failed: {type(err).__name__}: {err}", flush=True)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
