"""The balance step of a model with experts, after each optimizer step, and its figures.

Each MoE block's router counts the token copies it sends to each expert over the step's
forwards (``Router.tokens_per_expert``, this rank's tokens only) and its MoE accumulates the
auxiliary loss's value (``MoE.aux_loss_sum``, already scaled as its gradient is). After the
optimizer step ``ExpertBalance.__call__`` packs every MoE layer's counts and loss value into one
vector, slotted by the model's MoE layer (so a pipeline stage fills its own layers' slots and
leaves the others zero), and all-reduces it once over all ranks: each slot then sums the
ranks of the stage holding that layer (``dp_replicate x dp_shard x cp x tp``), every stage's
layers in the same collective. From the global counts it updates each layer's loss-free
balancing bias (DeepSeek-V3: ``expert_bias += speed x sign(mean - count)``, identically on
every rank), zeroes the counts and loss values, and returns the step's figures as 0-dim
device tensors, which the trainer reads with the step's own stats (one host read):

- ``moe/load_max_over_mean/layer_<i>``: the busiest expert's count over the mean count of
  MoE layer i (1 is perfect balance, n_experts / top_k the worst);
- ``moe/load_max_over_mean``: its largest value over the layers;
- ``moe/aux_loss``: the auxiliary loss of the step as one process computes it (all MoE
  layers'): the all-reduced sum divided by the ``dp x cp`` ranks whose losses the objective
  averages (each rank's value carries ``aux_grad_scale``: cp / micro-batches, whose
  micro-batches sum to cp; under a pipeline cp each, so also divided by the micro-batches).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hsdp_runner.distributed.expert_parallel import moe_modules
from hsdp_runner.distributed.parallel_dims import ParallelDims


class ExpertBalance:
    """The balance step over a rank's stage chunks ``parts``: ``moe_layers`` are the indices of
    every MoE block of the whole model (the same list on every rank, e.g. from a meta model's
    ``expert_parallel.moe_modules``), ``n_experts`` the routed experts of each, ``speed`` the
    bias update speed (``model.bias_update_speed``; 0: no bias update), ``device`` the rank's.
    Calling it runs the step (one all-reduce over all ranks: every rank calls it, holding MoE
    blocks or not) and returns the figures (see the module docstring)."""

    def __init__(
        self,
        parts: list[nn.Module],
        moe_layers: list[int],
        n_experts: int,
        speed: float,
        dims: ParallelDims,
        device: torch.device,
    ):
        self.device = device
        self.mine = {layer: moe for part in parts for layer, moe in moe_modules(part).items()}
        self.layers, self.n_experts, self.speed = list(moe_layers), n_experts, speed
        # The objective averages dp x cp ranks' losses; a pipeline's micro-batches each add
        # one scaled loss value (OneStage's add up to one).
        pipeline = dims.pp_stages > 1
        self.divisor = dims.dp_cp * (dims.pipeline.microbatches if pipeline else 1)

    @torch.no_grad()
    def __call__(self, applied: torch.Tensor) -> dict[str, torch.Tensor]:
        """All-reduce the step's counts and loss values, update the biases (times
        ``applied``, 0-dim: 0 when the optimizer skipped the step as non-finite, so the bias
        stays as the weights do), reset both; return {figure name: 0-dim device tensor}."""
        n_layers, n_experts = len(self.layers), self.n_experts
        packed = self._pack()
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        counts = packed[: n_layers * n_experts].view(n_layers, n_experts)
        aux = packed[n_layers * n_experts :]
        for slot, layer in enumerate(self.layers):
            moe = self.mine.get(layer)
            if moe is None:
                continue
            router = moe.router
            if self.speed:
                step = self.speed * torch.sign(counts[slot].mean() - counts[slot])
                router.expert_bias += applied.to(step.device) * step
            router.tokens_per_expert.zero_()
            moe.aux_loss_sum.zero_()
        load = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1.0)
        figures = {"moe/load_max_over_mean": load.max(), "moe/aux_loss": aux.sum() / self.divisor}
        for slot, layer in enumerate(self.layers):
            figures[f"moe/load_max_over_mean/layer_{layer}"] = load[slot]
        return figures

    def _pack(self) -> torch.Tensor:
        """This rank's counts (one row of n_experts per MoE layer), then its loss values (one
        per layer), in fp32; zeros in the slots of layers another stage holds."""
        n_layers, n_experts = len(self.layers), self.n_experts
        packed = torch.zeros(n_layers * (n_experts + 1), device=self.device)
        for slot, layer in enumerate(self.layers):
            moe = self.mine.get(layer)
            if moe is not None:
                packed[slot * n_experts : (slot + 1) * n_experts] = moe.router.tokens_per_expert
                packed[n_layers * n_experts + slot] = moe.aux_loss_sum
        return packed


def balance_step(
    parts: list[nn.Module],
    meta_model: nn.Module,
    n_experts: int,
    speed: float,
    dims: ParallelDims,
    device: torch.device,
) -> ExpertBalance | None:
    """The balance step of a rank holding ``parts`` (on ``device``) of a model with experts
    (``meta_model``: the whole model, on the meta device, whose MoE blocks give every rank the
    same layer slots); None for a dense model."""
    layers = sorted(moe_modules(meta_model))
    if not layers:
        return None
    return ExpertBalance(parts, layers, n_experts, speed, dims, device)
