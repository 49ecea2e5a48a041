"""A minimal hand-written FSDP2 (optionally + TP) training loop: the baseline overhead.py
compares the runner with. Run under torchrun:

    torchrun --standalone --nproc-per-node 2 benchmarks/minimal_fsdp.py --dp-shard 2 --tp 1 \
        --model llama3_debug --steps 12 --batch 8 --out times.json

Same model class, TP plan, FSDP2 wrapping (blocks, then the root without resharding after
forward), AdamW (fused, as the runner's), gradient clipping and loss as the runner: under TP the
output layer leaves the logits sharded over the vocabulary and the loss runs on the shards under
torch's ``loss_parallel`` (the runner's default ``parallel.loss_parallel=true``); none of its
config, checks, metrics, logging or checkpointing. Rank 0 writes the per-step times (train step
through loss.item()) as JSON. ``MinimalLoop`` is the same loop a step half at a time, for
``benchmarks/interleaved_steps.py``, which runs it beside the runner's trainer in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import loss_parallel

from hsdp_runner.models.llama import Llama, tp_plan

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


class MinimalLoop:
    """The minimal loop's model, optimizer and data on a (dp_shard, tp) mesh of the running
    process group. A step is ``forward_backward(step)`` then ``update()``; each returns the
    seconds it took (batch creation counted in the first, the loss read in the second)."""

    def __init__(self, dp_shard: int, tp: int, model_name: str, batch: int):
        self.tp, self.batch = tp, batch
        mesh = init_device_mesh("cpu", (dp_shard, tp), mesh_dim_names=("dp", "tp"))
        self.cfg = OmegaConf.load(CONF / f"{model_name}.yaml")
        with torch.device("meta"):
            model = Llama(self.cfg)
        if tp > 1:
            tp_plan(model, mesh["tp"], sequence_parallel=True, loss_parallel=True)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
        model.to_empty(device="cpu")
        model.init_weights(0)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
        self.local = batch // dp_shard
        self.dp_rank = mesh["dp"].get_local_rank()
        self.loss: torch.Tensor | None = None

    def forward_backward(self, step: int) -> float:
        """Make step ``step``'s batch, run its forward and backward; return the seconds."""
        start = time.perf_counter()
        gen = torch.Generator().manual_seed(step)
        data = torch.randint(
            0, self.cfg.vocab_size, (self.batch, self.cfg.seq_len + 1), generator=gen
        )
        data = data[self.dp_rank * self.local : (self.dp_rank + 1) * self.local]
        # torch requires the sharded loss's backward inside the same context as the loss.
        with loss_parallel() if self.tp > 1 else contextlib.nullcontext():
            logits = self.model(data[:, :-1])
            self.loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
            self.loss.backward()
        return time.perf_counter() - start

    def update(self) -> float:
        """Clip, step the optimizer, drop the gradients, read the loss; return the seconds."""
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss.item()
        return time.perf_counter() - start

    def close(self) -> None:
        """Drop the model and optimizer (orderly teardown: see TORCH_NOTES, the gloo abort at
        exit after DeviceMesh use)."""
        del self.model, self.opt, self.loss
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-shard", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--model", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    loop = MinimalLoop(args.dp_shard, args.tp, args.model, args.batch)
    times = [loop.forward_backward(step) + loop.update() for step in range(args.steps)]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"step_time_s": times}))
    loop.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
