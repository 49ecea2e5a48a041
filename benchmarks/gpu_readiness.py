"""Is this GPU machine ready? Train llama3_1b (or the largest shape that fits) on one GPU with
bf16 and torch.compile through the runner, print tokens/s, TFLOP/s, MFU and peak memory, then
a ready-to-run command for each GPU count.

    .venv/bin/python benchmarks/gpu_readiness.py [--steps 30] [--warmup 10]

Runs ``python -m hsdp_runner parallel=single launcher.nproc_per_node=1 precision=bf16
parallel.compile=true device=cuda`` (one rank, whatever the node's GPU count) for each
(model, global batch) in turn, largest first, and reports the first that trains; an
out-of-memory run moves on to the next. Then it prints, for 1, 2, 4, 8 GPUs (and this node's
count), the command that trains the same model and per-GPU batch over that many GPUs. Without
a GPU torch can use it names the cause (a CPU build, hidden GPUs, torch's own "CUDA
initialization" warning, e.g. a driver older than the wheel's CUDA), prints the commands for
the default batch and exits 0 without running anything.

First it reports the checks a first GPU run depends on: the torch build (``torch.version.cuda``,
``torch.cuda.is_available()``), the ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` a torchrun job would
get, and which attention kernel ``scaled_dot_product_attention`` runs on this device, with
whether ``parallel.ac=selective`` saves it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hsdp_runner.core.records import RunSummary  # noqa: E402
from hsdp_runner.distributed.hardware import cuda_available, cuda_unusable_cause  # noqa: E402
from hsdp_runner.distributed.parallelize import SDPA_FORWARD_OPS  # noqa: E402
from hsdp_runner.runtime.failures import NCCL_ERROR_HANDLING  # noqa: E402

# (model, global batch in sequences), largest first.
CANDIDATES = [
    ("llama3_1b", 8),
    ("llama3_1b", 4),
    ("llama3_1b", 2),
    ("llama3_1b", 1),
    ("llama3_debug", 16),
]


def overrides_for(gpus: int, model: str, batch_per_gpu: int) -> list[str]:
    """Runner overrides that train ``model`` on ``gpus`` GPUs of one node, ``batch_per_gpu``
    sequences each: one process for one GPU, FSDP over all of them otherwise."""
    layout = ["parallel=single"] if gpus == 1 else ["parallel=fsdp", f"parallel.dp_shard={gpus}"]
    return [
        *layout,
        f"launcher.nproc_per_node={gpus}",
        f"model={model}",
        "precision=bf16",
        "parallel.compile=true",
        "device=cuda",
        f"trainer.global_batch_size={gpus * batch_per_gpu}",
    ]


def commands(model: str, batch_per_gpu: int, visible: int = 0) -> dict[int, str]:
    """{GPU count: ready-to-run command line} for 1, 2, 4, 8 GPUs and the ``visible`` count."""
    counts = sorted({1, 2, 4, 8} | ({visible} if visible else set()))
    return {
        n: "python -m hsdp_runner " + " ".join(overrides_for(n, model, batch_per_gpu))
        for n in counts
    }


def print_commands(model: str, batch_per_gpu: int, visible: int) -> None:
    """Print ``commands`` as a short table, marking this node's GPU count."""
    fitted = "what fitted above" if visible else "not measured: no GPU here"
    print(
        f"\nready-to-run commands (model={model}, {batch_per_gpu} sequences per GPU, "
        f"{fitted}; more nodes: docs/many_nodes.md):"
    )
    for n, cmd in commands(model, batch_per_gpu, visible).items():
        mark = "  <- this node" if n == visible else ""
        print(f"  {n} GPU{'s' if n > 1 else ' '}: {cmd}{mark}")


def _run(model: str, batch: int, args, out: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "hsdp_runner",
        f"hydra.run.dir={out}",
        *overrides_for(1, model, batch),
        f"trainer.steps={args.steps}",
        f"metrics.warmup_steps={args.warmup}",
        "logger=none",
    ]
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)


def _out_of_memory(result: subprocess.CompletedProcess, out: Path) -> bool:
    error = (RunSummary.read(out) or RunSummary()).error or ""
    return "out of memory" in (result.stderr + error).lower()


def report(model: str, batch: int, out: Path) -> None:
    """Print the steady-state figures of a finished run from its summary.json."""
    s = RunSummary.read(out)
    mfu = (
        "unknown (set metrics.peak_tflops)"
        if s.median_mfu is None
        else f"{100 * s.median_mfu:.1f}%"
    )
    print(f"device: {s.device_name} (peak {s.peak_tflops} TFLOP/s: {s.peak_tflops_source})")
    print(
        f"model={model} global_batch={batch} seq_len from the model config, "
        f"{s.steady_steps} steady steps after {s.warmup_steps_excluded} warm-up"
    )
    print(
        f"tokens/s: {s.median_tps_per_device:,.0f}  TFLOP/s: {s.median_tflops:.1f}  "
        f"MFU: {mfu}  peak memory: {s.mem_peak_gib:.1f} GiB  "
        f"step: {s.median_step_time_s:.3f} s"
    )


def attention_kernel(device: torch.device) -> str | None:
    """The fused attention op (``aten._scaled_dot_product_*``) that a causal
    ``scaled_dot_product_attention`` with grad runs on ``device`` (bf16 on CUDA, as the probe
    trains; fp32 on CPU); None when none of ``SDPA_FORWARD_OPS`` ran. Seen through a dispatch
    mode, the hook selective checkpointing's policy itself sees ops through."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ran = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (
        torch.randn(1, 8, 256, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )
    with Ops():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return next((name for name in SDPA_FORWARD_OPS if name in ran), None)


def report_checks() -> None:
    """Print the checks a first GPU run depends on: torch build, NCCL error handling under
    torchrun, and the attention kernel selective activation checkpointing must save."""
    usable = cuda_available()
    print(
        f"torch {torch.__version__}: torch.version.cuda={torch.version.cuda}, "
        f"torch.cuda.is_available()={usable}"
    )
    key, ours = NCCL_ERROR_HANDLING
    have = os.environ.get(key)
    print(
        f"{key}: "
        + (f"{have}" if have is not None else "unset here")
        + f"; the runner's launcher gives its workers {ours}; under torchrun (whose agent "
        f"gives 1 unless set) export {key}={ours}"
    )
    device = torch.device("cuda") if usable else torch.device("cpu")
    kernel = attention_kernel(device)
    verdict = (
        "saved by parallel.ac=selective"
        if kernel
        else "no fused kernel: parallel.ac=selective recomputes attention"
    )
    print(f"attention runs aten.{kernel or 'math decomposition'}: {verdict} ({device.type})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out (compile)")
    args = parser.parse_args()
    report_checks()
    if not cuda_available():
        print(
            f"gpu_readiness: torch cannot use a GPU here: {cuda_unusable_cause()}; nothing "
            "was run. Run this on a GPU machine with a CUDA build of torch (docs/gpu.md)."
        )
        print_commands(*CANDIDATES[0], visible=0)
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-readiness-") as tmp:
        for model, batch in CANDIDATES:
            out = Path(tmp) / f"{model}_b{batch}"
            result = _run(model, batch, args, out)
            if result.returncode == 0:
                report(model, batch, out)
                print_commands(model, batch, torch.cuda.device_count())
                return 0
            if not _out_of_memory(result, out):
                print(result.stderr[-4000:], file=sys.stderr)
                print(
                    f"gpu_readiness: the run failed (exit code {result.returncode}), not for "
                    f"memory; logs in the output above",
                    file=sys.stderr,
                )
                return 1
            print(f"out of memory with model={model} global_batch={batch}; trying smaller")
    print("gpu_readiness: no candidate fitted in GPU memory", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
