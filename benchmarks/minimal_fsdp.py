"""A minimal hand-written FSDP2 (optionally + TP) training loop: the baseline overhead.py
compares the runner with. Run under torchrun:

    torchrun --standalone --nproc-per-node 2 benchmarks/minimal_fsdp.py --dp-shard 2 --tp 1 \
        --model llama3_debug --steps 12 --batch 8 --out times.json

Same model class, TP plan, FSDP2 wrapping (blocks, then the root without resharding after
forward), AdamW (fused, as the runner's), gradient clipping and loss as the runner: under TP the
output layer leaves the logits sharded over the vocabulary and the loss runs on the shards under
torch's ``loss_parallel`` (the runner's default ``parallel.loss_parallel=true``); none of its
config, checks, metrics, logging or checkpointing. Rank 0 writes the per-step times (train step
through loss.item()) as JSON.
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
    mesh = init_device_mesh("cpu", (args.dp_shard, args.tp), mesh_dim_names=("dp", "tp"))
    cfg = OmegaConf.load(CONF / f"{args.model}.yaml")
    with torch.device("meta"):
        model = Llama(cfg)
    if args.tp > 1:
        tp_plan(model, mesh["tp"], sequence_parallel=True, loss_parallel=True)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    model.to_empty(device="cpu")
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)

    local = args.batch // args.dp_shard
    dp_rank = mesh["dp"].get_local_rank()
    times = []
    for step in range(args.steps):
        start = time.perf_counter()  # batch creation included, as in the runner's step time
        gen = torch.Generator().manual_seed(step)
        data = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen)
        data = data[dp_rank * local : (dp_rank + 1) * local]
        # torch requires the sharded loss's backward inside the same context as the loss.
        with loss_parallel() if args.tp > 1 else contextlib.nullcontext():
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"step_time_s": times}))
    del model, opt
    gc.collect()  # orderly teardown: see TORCH_NOTES (gloo abort at exit after DeviceMesh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
