"""On a CUDA GPU: the experts' grouped matmul in TFLOP/s, and one MoE training step's MFU.

    .venv/bin/python benchmarks/moe_gpu.py [--model qwen3_30b_a3b] [--tokens 8192]
        [--repeats 20] [--warmup 5] [--layers 2] [--batch 4] [--seq-len 2048] [--steps 12]
        [--step-warmup 4] [--part all|matmul|step|float8]

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
- **float8** (not in ``all``: run it by name): (a) the experts' forward + backward
  (``GroupedExperts`` as the model runs them) in bf16 and converted to float8 by the runner
  (``float8_experts.convert_experts``: torchao's float8 rowwise grouped matmul, each expert's rows
  padded to 16) on the same ``--tokens`` routing: TFLOP/s of each (the counted FLOPs of the
  routed rows; the padding's are not counted), the speedup, and float8's relative error
  (||float8 - bf16|| / ||bf16||) of the output, the input's gradient and each weight's
  gradient; (b) the step job above in ``precision=bf16`` and ``precision=float8`` (linears
  tensorwise, experts rowwise): tokens/s, MFU and peak memory of each, and the largest
  relative difference of their losses over the steps. Meant to finish in well under 90 s on
  an H200 with ``--steps 8 --step-warmup 3``.

Exit code 0 when every part ran (or there is no GPU), 1 when one failed.
"""

from __future__ import annotations

import argparse
import copy
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
from hsdp_runner.distributed import float8_experts  # noqa: E402
from hsdp_runner.distributed.hardware import cuda_available, cuda_unusable_cause  # noqa: E402
from hsdp_runner.models.moe import MoEConfig  # noqa: E402
from hsdp_runner.train.metrics import lookup_peak_tflops  # noqa: E402
from hsdp_runner.train.sinks import read_metrics  # noqa: E402


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
    weight = torch.rand(rows, generator=gen, device=device)  # each row's router weight
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    w1, w2, w3 = (w.detach() for w in (grouped.w1, grouped.w2, grouped.w3))

    def grouped_forward():
        hidden = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        hidden = hidden * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offs)

    def forward_backward(experts):
        def run():
            x.requires_grad_(True)
            experts(x, counts, weight).backward(grad)
            experts.zero_grad(set_to_none=True)
            x.grad = None

        return run

    forward_flops = rows * 3 * 2 * cfg.dim * cfg.expert_ffn_dim
    cases = {
        "grouped forward": (grouped_forward, forward_flops),
        "loop forward": (lambda: loop(x.detach(), counts, weight), forward_flops),
        "grouped fwd+bwd": (forward_backward(grouped), 3 * forward_flops),
        "loop fwd+bwd": (forward_backward(loop), 3 * forward_flops),
    }
    figures = {}
    for name, (fn, flops) in cases.items():
        with torch.set_grad_enabled(name.endswith("fwd+bwd")):
            seconds = timed(fn, repeats, warmup, device)
        figures[name] = (flops / seconds / 1e12, seconds)
    return figures


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp32."""
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def float8_figures(cfg: MoEConfig, tokens: int, repeats: int, warmup: int) -> dict:
    """The experts' forward + backward in bf16 and in float8 (module docstring): {"bf16":
    (TFLOP/s, seconds), "float8": (TFLOP/s, seconds), "errors": {tensor: relative error}}."""
    device, dtype = "cuda", torch.bfloat16
    grouped, _ = moe_blocks(cfg, device, dtype)
    bf16 = grouped.experts
    f8 = copy.deepcopy(bf16)
    float8_experts.convert_experts(f8, torch.device(device))
    counts = routed_counts(cfg, tokens, device)
    rows = int(counts.sum())
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, cfg.dim, generator=gen, device=device, dtype=dtype)
    grad = torch.randn(rows, cfg.dim, generator=gen, device=device, dtype=dtype)
    weight = torch.rand(rows, generator=gen, device=device)  # each row's router weight

    def forward_backward(experts):
        xi = x.detach().requires_grad_(True)
        out = experts(xi, counts, weight)
        out.backward(grad)
        grads = [xi.grad, *(p.grad for p in experts.parameters())]
        experts.zero_grad(set_to_none=True)
        return out.detach(), grads

    results = {name: forward_backward(m) for name, m in (("bf16", bf16), ("float8", f8))}
    (out_b, grads_b), (out_f, grads_f) = results["bf16"], results["float8"]
    names = ["output", "input grad", *(f"{n} grad" for n, _ in bf16.named_parameters())]
    errors = dict(zip(names, map(relative_error, [out_f, *grads_f], [out_b, *grads_b])))
    flops = 3 * rows * 3 * 2 * cfg.dim * cfg.expert_ffn_dim  # forward + twice that backward
    figures = {"errors": errors}
    for name, experts in (("bf16", bf16), ("float8", f8)):
        seconds = timed(lambda e=experts: forward_backward(e), repeats, warmup, device)
        figures[name] = (flops / seconds / 1e12, seconds)
    return figures


def step_command(args, out_dir: Path, precision: str = "bf16") -> list[str]:
    """The runner's command line of the one-GPU MoE step job (see the module docstring) in
    ``precision`` (a conf/precision preset)."""
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
        f"precision={precision}",
        # The experts in float8 too (off in the presets: measured slower than bf16).
        *(["precision.float8_experts=true"] if precision != "bf16" else []),
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


def step_job(args, precision: str = "bf16") -> tuple[RunSummary, list[float]]:
    """Run the one-GPU MoE step job in ``precision``; returns its summary and its losses,
    one a step. Raises on a failed job."""
    with tempfile.TemporaryDirectory(prefix="moe-gpu-") as tmp:
        cmd = step_command(args, Path(tmp), precision)
        print("one MoE step:", " ".join(cmd[3:]), flush=True)
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the job failed ({result.returncode}): {result.stderr[-3000:]}")
        return RunSummary.read(tmp), [r["loss"] for r in read_metrics(tmp) if "loss" in r]


def print_step(s: RunSummary) -> None:
    """One line of a step job's medians."""
    mfu = "n/a (unknown peak)" if s.median_mfu is None else f"{100 * s.median_mfu:.1f}%"
    print(
        f"  {s.median_tps_global:,.0f} tokens/s, {s.median_tflops:.1f} TFLOP/s, MFU {mfu} "
        f"(active parameters, {s.flops_per_token:.3g} FLOPs/token), step "
        f"{s.median_step_time_s:.3f} s, peak memory {s.mem_peak_gib:.1f} GiB (medians after "
        f"{s.warmup_steps_excluded} steps)",
        flush=True,
    )


def run_step(args) -> None:
    """Run the one-GPU MoE step job and print its figures; raises on a failed job."""
    print_step(step_job(args)[0])


def run_float8(args, name: str) -> None:
    """The float8 part (module docstring): the experts' matmuls, then the two step jobs."""
    cfg = preset(args.model)
    fig = float8_figures(cfg, args.tokens, args.repeats, args.warmup)
    (bf16, t_b), (f8, t_f) = fig["bf16"], fig["float8"]
    print(
        f"float8 experts: {cfg.name} ({cfg.n_experts} of {cfg.dim} x {cfg.expert_ffn_dim}, "
        f"top {cfg.top_k}), {args.tokens} tokens, forward + backward, median of "
        f"{args.repeats} after {args.warmup}"
    )
    print(f"  bf16   {bf16:8.1f} TFLOP/s  {1e3 * t_b:.3f} ms")
    print(f"  float8 {f8:8.1f} TFLOP/s  {1e3 * t_f:.3f} ms  speedup {t_b / t_f:.2f}x")
    errors = ", ".join(f"{k} {v:.2e}" for k, v in fig["errors"].items())
    print(f"  float8 vs bf16 relative error: {errors}", flush=True)
    runs = {}
    for precision in ("bf16", "float8"):
        runs[precision] = step_job(args, precision)
        print_step(runs[precision][0])
    (s_b, loss_b), (s_f, loss_f) = runs["bf16"], runs["float8"]
    diffs = [abs(f - b) / abs(b) for f, b in zip(loss_f, loss_b)]
    if not diffs:
        raise RuntimeError("the step jobs recorded no losses")
    print(
        f"  float8 / bf16: tokens/s {s_f.median_tps_global / s_b.median_tps_global:.2f}x, "
        f"peak memory {s_f.mem_peak_gib - s_b.mem_peak_gib:+.1f} GiB; losses over "
        f"{len(diffs)} steps: largest relative difference {max(diffs):.2e}, last "
        f"{diffs[-1]:.2e} (bf16 {loss_b[-1]:.4f}, float8 {loss_f[-1]:.4f})",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the parts on the GPU; returns the exit code (see the docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part",
        choices=("all", "matmul", "step", "float8"),
        default="all",
        help="all: matmul and step; float8 runs only by name",
    )
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
    parts = {
        "matmul": lambda: run_matmul(args, name),
        "step": lambda: run_step(args),
        "float8": lambda: run_float8(args, name),
    }
    for part, run in parts.items():
        if args.part != part and (args.part != "all" or part == "float8"):
            continue
        try:
            run()
        except Exception as err:  # report the part and go on: the other may still run
            print(f"{part} failed: {type(err).__name__}: {err}", flush=True)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
