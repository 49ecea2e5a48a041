"""A rank's training job built inside a test's worker function, as ``runtime.rank_training``
builds one: the world mesh of the config's degrees, the stage chunks and their schedule
(``build_rank_model``), the run's fixed figures and the trainer, without sinks."""

from __future__ import annotations

import torch


def rank_trainer(
    cfg,
    device: torch.device | None = None,
    timeout_s: float | None = None,
    ranks_per_node: int | None = None,
):
    """(trainer, dims) of the typed config ``cfg`` on this rank of the running process group
    (``device``: the CPU by default; ``timeout_s``: the mesh's collective timeout, None: the
    process group's; ``ranks_per_node``: the ranks per node the job is told, as a launch's
    LOCAL_WORLD_SIZE tells it, None: one node); ``trainer.parts`` holds the rank's stage
    chunks."""
    import torch.distributed as dist

    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.runtime.rank_training import build_rank_model, make_trainer
    from hsdp_runner.train.figures import compute_run_figures

    device = device or torch.device("cpu")
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, dist.get_world_size(), ranks_per_node)
    world = dims.build_mesh(device.type, timeout_s)
    schedule = build_rank_model(cfg, dims, world, device)
    figures = compute_run_figures(cfg, dims, schedule.parts, device)
    return make_trainer(cfg, dims, world, schedule, device, figures, trackers=[]), dims
