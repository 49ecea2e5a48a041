"""Pipeline parallel: this rank's stage chunks, their ``PipelineStage``s and the schedule.

``build_pipeline`` cuts the model into ``pp x pp_stages_per_rank`` stages (the family's split,
``models/base.stage_blocks``) and builds this rank's: stage ``pp_rank + i x pp`` for i < stages per
rank (torch's loop placement, which the interleaved schedules expect). Each chunk is
parallelized on its own (TP, AC, compile, FSDP/HSDP: ``parallelize.build_model``), so FSDP
units never span stages and every parameter keeps the unsplit model's name. The schedule
(``torch.distributed.pipelining``) cuts the rank's batch into ``pp_microbatches`` micro-batches,
sends activations forward and their gradients back over the ``pp`` mesh dim, computes the loss
on the last stage and scales gradients by 1/micro-batches (each micro-batch's loss is a mean,
so the step's gradient is that of the batch mean, as without a pipeline).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hsdp_runner.config.schema import ParallelConfig, PrecisionConfig
from hsdp_runner.core.choices import INTERLEAVED_SCHEDULES
from hsdp_runner.distributed.parallel_dims import ParallelDims, WorldMesh
from hsdp_runner.models.base import ModelConfig


def local_stages(pp_rank: int, dims: ParallelDims) -> list[int]:
    """The stage indices rank ``pp_rank`` of the ``pp`` dim holds: r, r + pp, ... (loop)."""
    return [pp_rank + i * dims.pp for i in range(dims.pp_stages_per_rank)]


def _schedule_class(name: str):
    """The torch schedule class of ``parallel.pp_schedule`` ``name``."""
    from torch.distributed import pipelining

    return {
        "gpipe": pipelining.ScheduleGPipe,
        "1f1b": pipelining.Schedule1F1B,
        "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
        "interleaved_zb": pipelining.ScheduleInterleavedZeroBubble,
    }[name]


class Pipeline:
    """This rank's stage chunks (``chunks``: modules named as the unsplit model, in stage
    order), their PipelineStages and the schedule; ``step`` runs one batch.

    Takes the chunks, their stage indices, the job's ParallelDims and world mesh, the device
    and ``loss_fn(logits, targets) -> mean loss`` of one micro-batch.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        stage_ids: list[int],
        dims: ParallelDims,
        world: WorldMesh,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        from torch.distributed.pipelining import PipelineStage

        self.chunks, self.stage_ids, self.device = chunks, stage_ids, device
        self.n_stages, self.microbatches = dims.pp_stages, dims.pp_microbatches
        self.is_first = 0 in stage_ids
        self.is_last = self.n_stages - 1 in stage_ids
        self.pp_group = world["pp"].get_group()
        self.poisoned = False  # fault injection: the next step's losses are NaN
        self._loss_fn = loss_fn
        stages = [
            PipelineStage(chunk, sid, self.n_stages, device, group=self.pp_group)
            for chunk, sid in zip(chunks, stage_ids)
        ]
        schedule = _schedule_class(dims.pp_schedule.value)
        multi = dims.pp_schedule in INTERLEAVED_SCHEDULES
        self.schedule = schedule(
            stages if multi else stages[0],
            n_microbatches=self.microbatches,
            loss_fn=self._loss,
            scale_grads=True,
        )

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self._loss_fn(logits, targets)
        # The zero-bubble schedule detaches the loss in place after the input gradients, which
        # a view cannot be, and the vocabulary-sharded loss (DTensor.to_local) is one: a copy.
        return loss * float("nan") if self.poisoned else loss.clone()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, poison: bool = False):
        """Forward and backward of the rank's batch through the schedule; gradients land in
        the chunks' parameters. Returns the mean micro-batch loss (0-dim, on the device) on
        the rank holding the last stage, zero elsewhere; queues device work only."""
        self.poisoned = poison
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        self.schedule.step(
            *args, target=targets if self.is_last else None, losses=losses, return_outputs=False
        )
        return self._mean(losses)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of one batch, forward only (zero on ranks without the last stage)."""
        self.poisoned = False
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        self.schedule.eval(*args, target=targets if self.is_last else None, losses=losses)
        return self._mean(losses)

    def _mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if not self.is_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).mean()


def merged_view(chunks: list[nn.Module]) -> nn.Module:
    """One module holding every chunk of ``chunks`` (a rank's stage chunks) under the unsplit
    model's names: the blocks of all chunks in one ModuleDict, each end module (embedding,
    final norm, output) once; the chunk itself when there is one. The modules are shared, not
    copied. For what reads or writes a model's state by name: torch's ``get_state_dict`` /
    ``set_state_dict`` take one module holding every parameter the optimizer steps, and an
    ``nn.ModuleList`` of the chunks would prefix each name with its chunk's index."""
    if len(chunks) == 1:
        return chunks[0]
    view = nn.Module()
    for chunk in chunks:
        if next(chunk.parameters(recurse=False), None) is not None:
            raise ValueError("a stage chunk with parameters of its own cannot be merged by name")
        for name, child in chunk.named_children():
            if isinstance(child, nn.ModuleDict):
                held = view._modules.get(name)
                if held is None:
                    held = nn.ModuleDict()
                    setattr(view, name, held)
                held.update(child)
            elif child is not None:
                setattr(view, name, child)
    return view


def build_pipeline(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    world: WorldMesh,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    device: torch.device,
    seed: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    freeze=(),
) -> Pipeline:
    """Build this rank's stage chunks, each parallelized and initialised as
    ``parallelize.build_model`` does a whole model (same arguments: the ``model``,
    ``parallel`` and ``precision`` configs), and the Pipeline over them."""
    from hsdp_runner.distributed.parallelize import build_model

    stage_ids = local_stages(world.local_rank_in("pp"), dims)
    chunks = [
        build_model(model_cfg, dims, world, parallel, precision, device, seed, freeze, stage=s)
        for s in stage_ids
    ]
    return Pipeline(chunks, stage_ids, dims, world, device, loss_fn)
