"""Is this GPU machine ready? Train llama3_1b (or the largest shape that fits) on one GPU with
bf16 and torch.compile through the runner, and print tokens/s, TFLOP/s, MFU and peak memory.

    .venv/bin/python benchmarks/gpu_readiness.py [--steps 30] [--warmup 10]

Runs ``python -m hsdp_runner parallel=single precision=bf16 parallel.compile=true device=cuda``
for each (model, global batch) in turn, largest first, and reports the first that trains; an
out-of-memory run moves on to the next. Without a visible CUDA GPU it says so and exits 0
without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# (model, global batch in sequences), largest first.
CANDIDATES = [("llama3_1b", 8), ("llama3_1b", 4), ("llama3_1b", 2), ("llama3_1b", 1),
              ("llama3_debug", 16)]


def _run(model: str, batch: int, args, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hsdp_runner", f"hydra.run.dir={out}", "parallel=single",
           f"model={model}", "precision=bf16", "parallel.compile=true", "device=cuda",
           f"trainer.steps={args.steps}", f"trainer.global_batch_size={batch}",
           f"metrics.warmup_steps={args.warmup}", "logger=none"]
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)


def _out_of_memory(result: subprocess.CompletedProcess, out: Path) -> bool:
    summary = out / "summary.json"
    error = json.loads(summary.read_text()).get("error") or "" if summary.exists() else ""
    return "out of memory" in (result.stderr + error).lower()


def report(model: str, batch: int, out: Path) -> None:
    """Print the steady-state figures of a finished run from its summary.json."""
    s = json.loads((out / "summary.json").read_text())
    mfu = "unknown (set metrics.peak_tflops)" if s["median_mfu"] is None \
        else f"{100 * s['median_mfu']:.1f}%"
    print(f"device: {s['device_name']} (peak {s['peak_tflops']} TFLOP/s: "
          f"{s['peak_tflops_source']})")
    print(f"model={model} global_batch={batch} seq_len from the model config, "
          f"{s['steady_steps']} steady steps after {s['warmup_steps_excluded']} warm-up")
    print(f"tokens/s: {s['median_tps_per_device']:,.0f}  TFLOP/s: {s['median_tflops']:.1f}  "
          f"MFU: {mfu}  peak memory: {s['mem_peak_gib']:.1f} GiB  "
          f"step: {s['median_step_time_s']:.3f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out (compile)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
        print(f"gpu_readiness: no CUDA GPU is visible (torch {torch.__version__}, {build}); "
              "nothing was run. Run this on a GPU machine with a CUDA build of torch.")
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-readiness-") as tmp:
        for model, batch in CANDIDATES:
            out = Path(tmp) / f"{model}_b{batch}"
            result = _run(model, batch, args, out)
            if result.returncode == 0:
                report(model, batch, out)
                return 0
            if not _out_of_memory(result, out):
                print(result.stderr[-4000:], file=sys.stderr)
                print(f"gpu_readiness: the run failed (exit code {result.returncode}), not for "
                      f"memory; logs in the output above", file=sys.stderr)
                return 1
            print(f"out of memory with model={model} global_batch={batch}; trying smaller")
    print("gpu_readiness: no candidate fitted in GPU memory", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
