"""The runner's trainer and the minimal FSDP2 loop stepped in turn in the same processes, on
the same ranks: the step-time comparison of ``benchmarks/overhead.py``. Run under torchrun:

    PYTHONPATH=. torchrun --standalone --nproc-per-node 4 benchmarks/interleaved_steps.py \
        --dp-shard 2 --tp 2 --model llama3_debug --steps 30 --batch 8 --out times.json

(``PYTHONPATH``: it imports ``benchmarks.minimal_fsdp``; ``overhead.py`` sets it for its runs.)

Two separate commands timed one after the other see this machine drift by 25-30% within
minutes, more than the overhead being measured. Here both loops share the process, the mesh's
ranks, the threads and the moment: the runner's own ``Trainer.fit`` (``runtime.rank_training.
rank_trainer``: the build a job runs, ``logger=none``, the job's step-time marks) runs its
steps, and at each step boundary its ``after_step`` hook (where a job checkpoints) runs the
minimal loop's update of its previous step and the forward and backward of its next
(``minimal_fsdp.MinimalLoop``). So each loop's forward-backward follows its own update and each
loop's update follows the other's forward-backward: neither finds the other's caches on only
one side. Rank 0 writes {"runner": [...], "minimal": [...]} step times (seconds) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist

from benchmarks.minimal_fsdp import MinimalLoop
from hsdp_runner.config.compose import compose, to_run_config
from hsdp_runner.distributed.hardware import set_cpu_threads
from hsdp_runner.runtime.rank_training import rank_trainer
from hsdp_runner.train.trainer import Trainer


def runner_overrides(dp_shard: int, tp: int, model: str, steps: int, batch: int) -> list[str]:
    """The runner's config for one layout of the comparison: its defaults, the same model,
    degrees, steps and global batch as the minimal loop's, no tracker."""
    return [
        "parallel=fsdp_tp",
        "parallel.dp_replicate=1",
        f"parallel.dp_shard={dp_shard}",
        f"parallel.tp={tp}",
        f"model={model}",
        f"trainer.steps={steps}",
        f"trainer.global_batch_size={batch}",
        "logger=none",
    ]


def interleave(trainer: Trainer, minimal: MinimalLoop) -> tuple[list[float], list[float]]:
    """Run ``trainer.fit()`` with the minimal loop's steps between the runner's (see the module
    docstring): both take ``trainer.train.steps`` steps. Returns (the runner's step times, the
    minimal loop's), seconds."""
    steps = trainer.train.steps
    halves = [minimal.forward_backward(0)]  # minimal step k = halves[2k] + halves[2k + 1]

    def after_step(done: int) -> None:
        # The runner has reported its step ``done`` (1-based) and run the next one's forward
        # and backward; its update follows this hook.
        halves.append(minimal.update())
        if done < steps:
            halves.append(minimal.forward_backward(done))

    records = trainer.fit(after_step=after_step)
    return [r["step_time_s"] for r in records], [
        halves[2 * k] + halves[2 * k + 1] for k in range(steps)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-shard", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--model", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))  # as a job's worker does
    dist.init_process_group("gloo")
    cfg = to_run_config(
        compose(runner_overrides(args.dp_shard, args.tp, args.model, args.steps, args.batch))
    )
    trainer, _ = rank_trainer(cfg)
    minimal = MinimalLoop(args.dp_shard, args.tp, args.model, args.batch)
    runner_times, minimal_times = interleave(trainer, minimal)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"runner": runner_times, "minimal": minimal_times}))
    minimal.close()
    del trainer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
