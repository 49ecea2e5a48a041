"""A rank's model as a list of stages and the schedule that runs them: one path for every layout.

A rank holds ``parts``, its stage chunks in stage order, each parallelized on its own (TP, AC,
compile, FSDP/HSDP/DDP: ``parallelize.build_model``), so FSDP units never span stages and every
parameter keeps the whole model's name. ``build_stages`` builds them and the schedule that runs
a step through them; the trainer, the checkpointer, the float8 hooks and the run's figures read
``schedule.parts`` and nothing else.

- **No pipeline** (``parallel.pp=1``): one part, the whole model (stage 0 of 1, both ends),
  run by ``OneStage``, the trivial schedule: forward and backward of each of
  ``trainer.grad_accum_steps`` micro-batches in turn, the gradient sync of each micro-batch
  switched as ``trainer.accum_reduce`` asks (``parallelize.set_gradient_sync``).
- **Pipeline parallel**: ``pp x pp_stages_per_rank`` stages (the family's split,
  ``models/base.stage_blocks``); this rank builds stage ``pp_rank + i x pp`` for i < stages per
  rank (torch's loop placement, which the interleaved schedules expect). ``PipelineSchedule``
  runs torch's schedule (``torch.distributed.pipelining``): it cuts the rank's batch into
  ``pp_microbatches`` micro-batches, sends activations forward and their gradients back over
  the ``pp`` mesh dim, computes the loss on the last stage and scales gradients by
  1/micro-batches (each micro-batch's loss is a mean, so the step's gradient is that of the
  batch mean, as without a pipeline).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hsdp_runner.config.schema import ParallelConfig, PrecisionConfig, TrainerConfig
from hsdp_runner.core.choices import INTERLEAVED_SCHEDULES, AccumReduce
from hsdp_runner.distributed import float8
from hsdp_runner.distributed.expert_parallel import reset_statistics, set_aux_grad_scale
from hsdp_runner.distributed.parallel_dims import ParallelDims, WorldMesh
from hsdp_runner.distributed.parallelize import build_model, set_gradient_sync
from hsdp_runner.models.base import ModelConfig

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Schedule:
    """What a step runs through: the rank's ``parts`` (stage chunks named as the whole model,
    in stage order) with their ``stage_ids`` of ``n_stages``, and a loss function
    ``loss_fn(logits, targets) -> mean loss`` of one micro-batch.

    ``step`` runs one batch's forward and backward, ``eval_loss`` one batch's forward.
    ``is_last``: the rank computes the loss (holds the last stage). ``pp_group``: the process
    group the stages' gradient norms sum over (None with one stage). ``repeated_from``: the
    first step that every later step repeats (communication is counted there by default).
    """

    pp_group: dist.ProcessGroup | None = None
    repeated_from = 1

    def __init__(self, parts: list[nn.Module], stage_ids: list[int], n_stages: int, loss_fn):
        self.parts, self.stage_ids, self.n_stages = parts, stage_ids, n_stages
        self.is_first = 0 in stage_ids
        self.is_last = n_stages - 1 in stage_ids
        self.poisoned = False  # fault injection: this step's losses are NaN
        self._loss_fn = loss_fn

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss (NaN while ``poisoned``)."""
        loss = self._loss_fn(logits, targets)
        return loss * float("nan") if self.poisoned else loss

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, poison: bool = False):
        """Forward and backward of the rank's batch (on the device); gradients land in the
        parts' parameters. Returns the batch's mean loss (0-dim, on the device) where
        ``is_last``, zero elsewhere; queues device work only. ``poison``: NaN losses."""
        raise NotImplementedError

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of one batch, forward only (zero where not ``is_last``)."""
        raise NotImplementedError


class OneStage(Schedule):
    """The trivial schedule of a rank holding the whole model (one stage, both ends): each of
    ``microbatches`` micro-batches' forward and backward in turn, with the gradient sync that
    ``accum_reduce`` asks for (``parallelize.set_gradient_sync``) switched before each.
    ``repeated_from``: the first step every later one repeats (2 under float8 all-gather: the
    first step has no precomputed scales, so torchao all-reduces each weight's amax at every
    gather)."""

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        loss_fn: LossFn,
        microbatches: int,
        accum_reduce: AccumReduce,
        repeated_from: int = 1,
    ):
        super().__init__([model], [0], 1, loss_fn)
        self.dims, self.microbatches, self.accum_reduce = dims, microbatches, accum_reduce
        self.repeated_from = repeated_from

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, poison: bool = False):
        self.poisoned = poison
        model, accum = self.parts[0], self.microbatches
        total = torch.zeros((), device=inputs.device)
        for micro, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
            set_gradient_sync(model, self.dims, self.accum_reduce, micro == accum - 1)
            loss = self.loss(model(x), y) / accum
            loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.poisoned = False
        return self.loss(self.parts[0](inputs), targets)


def _schedule_class(name: str):
    """The torch schedule class of ``parallel.pp_schedule`` ``name``."""
    from torch.distributed import pipelining

    return {
        "gpipe": pipelining.ScheduleGPipe,
        "1f1b": pipelining.Schedule1F1B,
        "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
        "interleaved_zb": pipelining.ScheduleInterleavedZeroBubble,
    }[name]


class PipelineSchedule(Schedule):
    """torch's pipeline schedule (``parallel.pp_schedule``) over this rank's stage chunks
    ``parts`` (stage indices ``stage_ids``), on ``device``, sending over the world mesh's
    ``pp`` dim. A pipeline's first step also runs torch's runtime shape inference (a forward
    that all-gathers FSDP's units once more, and metadata sends), so the second step is the
    one every later step repeats. That forward (a first stage's on the first micro-batch, a
    later stage's on uninitialised inputs) must not count in a mixture of experts' balance
    statistics: they are reset when the real forwards begin (``_forget_shape_inference``)."""

    repeated_from = 2

    def __init__(
        self,
        parts: list[nn.Module],
        stage_ids: list[int],
        dims: ParallelDims,
        world: WorldMesh,
        device: torch.device,
        loss_fn: LossFn,
    ):
        from torch.distributed.pipelining import PipelineStage

        super().__init__(parts, stage_ids, dims.pp_stages, loss_fn)
        self.device = device
        self.pp_group = world["pp"].get_group()
        stages = [
            PipelineStage(part, sid, self.n_stages, device, group=self.pp_group)
            for part, sid in zip(parts, stage_ids)
        ]
        multi = dims.pipeline.schedule in INTERLEAVED_SCHEDULES
        self.schedule = _schedule_class(dims.pipeline.schedule.value)(
            stages if multi else stages[0],
            n_microbatches=dims.pipeline.microbatches,
            loss_fn=self.loss,
            scale_grads=True,
        )

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss as a tensor of its own: the zero-bubble schedule
        detaches the loss in place after the input gradients, which a view cannot be, and the
        vocabulary-sharded loss (``DTensor.to_local``) is one."""
        return super().loss(logits, targets).clone()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, poison: bool = False):
        self.poisoned = poison
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        hooks = self._forget_shape_inference() if self._infers_shapes else []
        self.schedule.step(
            *args, target=targets if self.is_last else None, losses=losses, return_outputs=False
        )
        for hook in hooks:
            hook.remove()
        self._infers_shapes = False
        return self._mean(losses)

    # torch infers the stages' shapes at the first training step and again at the first one
    # after an evaluation (its eval/train switch).
    _infers_shapes = True

    def _forget_shape_inference(self) -> list:
        """Forward pre-hooks on the parts that, at each part's second forward of the step (its
        first real micro-batch: the first was torch's shape inference), reset the part's
        mixture-of-experts statistics (``expert_parallel.reset_statistics``). Returns them."""
        hooks = []
        for part in self.parts:
            calls = [0]

            def forget(module, args, part=part, calls=calls):
                calls[0] += 1
                if calls[0] == 2:
                    reset_statistics(part)

            hooks.append(part.register_forward_pre_hook(forget))
        return hooks

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.poisoned = False
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        self.schedule.eval(*args, target=targets if self.is_last else None, losses=losses)
        self._infers_shapes = True
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


def build_stages(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    world: WorldMesh,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    trainer: TrainerConfig,
    device: torch.device,
    loss_fn: LossFn,
) -> Schedule:
    """Build this rank's stage chunks on ``device``, each parallelized and initialised as
    ``parallelize.build_model`` does (the ``model``, ``parallel`` and ``precision`` configs;
    the ``trainer`` config's seed, frozen names, micro-batches and their gradient reduction),
    and return the schedule that runs them (``schedule.parts``): ``OneStage`` over the whole
    model without pipeline parallel, else ``PipelineSchedule``. ``loss_fn(logits, targets)``:
    the mean loss of one micro-batch."""
    stage_ids = dims.local_stages(world.local_rank_in("pp"))
    parts = [
        build_model(
            model_cfg, dims, world, parallel, precision, device, trainer.seed, trainer.freeze, s
        )
        for s in stage_ids
    ]
    # A mixture of experts' auxiliary-loss gradient: cp / micro-batches, as OneStage divides
    # each micro-batch's loss; torch's pipeline schedules divide the gradients themselves.
    for part in parts:
        set_aux_grad_scale(part, dims.cp / (trainer.grad_accum_steps if dims.pp_stages == 1 else 1))
    if dims.pp_stages == 1:
        first_repeated = 2 if float8.gathers_float8(precision, dims.dp_mode) else 1
        return OneStage(
            parts[0], dims, loss_fn, trainer.grad_accum_steps, trainer.accum_reduce, first_repeated
        )
    return PipelineSchedule(parts, stage_ids, dims, world, device, loss_fn)
