"""``parallel=auto`` under each launcher: which one process plans, and how every rank of the
job comes to run the degrees it chose (the planning itself is ``planner.auto``).

- ``launcher=local``: the process that starts the workers plans, before they start.
- torchrun: every rank runs ``prelaunch.validate``. Rank 0 alone plans (into the job's dir), then
  publishes the choice, or its ConfigError's text, in torchrun's agent store: the TCPStore
  the elastic agent hosts at MASTER_ADDR:MASTER_PORT (``TORCHELASTIC_USE_AGENT_STORE``), under
  a key of the run id and restart count, so a restarted group never reads an old plan. The
  other ranks wait for it (up to ``launcher.timeout_s``) and write it into their config, or
  exit 2 with rank 0's error. The world comes from torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE.
- SLURM (``launcher=slurm`` / ``slurm_local``): the submitting process plans each job before
  anything is queued (``prelaunch.check_before_submit``), for ``launcher.nnodes`` x
  ``launcher.nproc_per_node`` ranks on ``cluster=<preset>`` (a login node has no GPU to name
  one), into the dir Hydra will give the job; the job's tasks run that plan.json's choice and
  never plan (``planner.auto.adopt_plan``).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from hsdp_runner.config.compose import CONF_DIR
from hsdp_runner.config.schema import RunConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.parallel_dims import DIM_NAMES
from hsdp_runner.planner import auto as plan_auto
from hsdp_runner.planner.report import PLAN_JSON
from hsdp_runner.runtime import forkserver
from hsdp_runner.runtime.slurm import in_submitit_job

STORE_KEY = "hsdp_runner/parallel_auto"
_UNKNOWN_JOB_ID = "<job id>"  # stands in for hydra.job.id, which SLURM assigns on submission


def _rank() -> int | None:
    """This process's global rank under an external launcher, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def check_launch(cfg: RunConfig, gpus: int, submitting: bool) -> None:
    """Refuse ``parallel=auto`` where no one process can plan for every rank before the ranks
    build their mesh, or where the world size would come from degrees yet to be chosen.

    ``gpus``: the GPUs this process may use; ``submitting``: this process only submits the job
    to SLURM. Raises ConfigError naming the fix."""
    if submitting:
        if cfg.cluster is None:
            presets = ", ".join(p.stem for p in sorted((CONF_DIR / "cluster").glob("*.yaml")))
            raise ConfigError(
                f"parallel=auto with launcher={cfg.launcher.name} plans before submitting, on "
                f"this node, which does not have the job's GPUs: name the cluster to plan for "
                f"with cluster=<preset> ({presets})"
            )
        return
    if _rank() is not None:
        if in_submitit_job():
            return
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            raise ConfigError(
                "parallel=auto with RANK and WORLD_SIZE set by a launcher other than torchrun "
                "or launcher=slurm: no rank could hand its plan to the others; plan first "
                "(python -m hsdp_runner.plan ... plan.write_sweep=<file>) and run its degrees"
            )
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
            raise ConfigError(
                "parallel=auto under torchrun hands rank 0's plan to the other ranks through "
                "torchrun's agent store, which this launch does not share "
                "(TORCHELASTIC_USE_AGENT_STORE is not True): unset "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE, or plan first and run its degrees"
            )
        return
    degrees = [getattr(cfg.parallel, name) for name in DIM_NAMES]
    if not gpus and cfg.launcher.nproc_per_node is None and -1 in degrees:
        raise ConfigError(
            "parallel=auto on CPU needs the number of ranks to plan for and start: "
            "set launcher.nproc_per_node (e.g. launcher.nproc_per_node=4)"
        )


def settle(
    cfg: DictConfig,
    world_size: int,
    ranks_per_node: int,
    gpus: int,
    output_dir: Path,
    overrides: list[str],
) -> None:
    """Write the degrees this job runs into its composed config ``cfg``: planned here (the
    launching or submitting process, torchrun's rank 0), received from torchrun's rank 0, or
    read from the plan made before a SLURM job was submitted (see the module docstring).
    ``output_dir``: the job's dir (its ``plan/`` holds the plan); ``overrides``: its command
    line, recorded in plan.md. ConfigError when nothing fits, or rank 0 could not plan."""
    rank, plan_dir = _rank(), output_dir / plan_auto.PLAN_DIR
    if rank is None:
        plan_here(cfg, world_size, ranks_per_node, gpus, plan_dir, overrides, in_launcher=True)
    elif in_submitit_job():
        plan_json = plan_dir / PLAN_JSON
        row = plan_auto.adopt_plan(cfg, plan_json, world_size, ranks_per_node)
        if rank == 0:
            print(f"hsdp_runner: {plan_auto.describe_adopted(row, plan_json)}", flush=True)
    else:
        _plan_on_rank_0(cfg, rank, world_size, ranks_per_node, gpus, plan_dir, overrides)


def _plan_on_rank_0(
    cfg: DictConfig,
    rank: int,
    world_size: int,
    ranks_per_node: int,
    gpus: int,
    plan_dir: Path,
    overrides: list[str],
) -> None:
    """torchrun: rank 0 plans and publishes the choice (or its ConfigError's text) in the agent
    store; every other rank waits for it and writes it into ``cfg`` (or raises its error)."""
    timeout_s = cfg.launcher.timeout_s
    store, key = agent_store(timeout_s), store_key()
    if rank != 0:
        choice = receive(store, key, timeout_s)
        plan_auto.apply_choice(cfg, choice["overrides"], choice["plan_source"], choice["cluster"])
        return
    try:
        planned = plan_here(cfg, world_size, ranks_per_node, gpus, plan_dir, overrides)
    except ConfigError as err:
        store.set(key, json.dumps({"error": str(err)}))
        raise
    choice = {
        "overrides": planned.chosen["overrides"],
        "plan_source": str(planned.plan_json),
        "cluster": OmegaConf.to_container(cfg.cluster, resolve=True, enum_to_str=True),
    }
    store.set(key, json.dumps(choice))


def plan_here(
    cfg: DictConfig,
    world_size: int,
    ranks_per_node: int,
    gpus: int,
    plan_dir: Path,
    overrides: list[str],
    in_launcher: bool = False,
) -> plan_auto.AutoChoice:
    """Plan the job in this process (the cluster: ``cluster=``, else GPU 0's preset, else
    this_machine), write the choice into ``cfg`` and the plan into ``plan_dir``, print the
    choice and the runner-up; return the choice. ConfigError when nothing fits.
    ``in_launcher``: this is the job's launcher, not a rank (``forkserver.plan_children``)."""
    device_name = torch.cuda.get_device_name(0) if gpus else None
    forkserver.plan_children(from_here=in_launcher)
    choice = plan_auto.plan_job(cfg, world_size, ranks_per_node, device_name, plan_dir, overrides)
    print(f"hsdp_runner: {plan_auto.describe(choice)}", flush=True)
    return choice


def store_key() -> str:
    """The agent-store key of this torchrun group's plan: per run id and restart count."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"{STORE_KEY}/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def agent_store(timeout_s: float):
    """A client of torchrun's agent store (the elastic agent hosts it at MASTER_ADDR:
    MASTER_PORT), whose calls give up after ``timeout_s`` seconds."""
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )


def receive(store, key: str, timeout_s: float) -> dict:
    """Wait up to ``timeout_s`` seconds for rank 0's plan under ``key``; return the choice
    (``overrides``, ``plan_source``, ``cluster``). ConfigError with rank 0's error, or when
    nothing came in time."""
    from torch.distributed import DistStoreError

    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except DistStoreError:
        raise ConfigError(
            f"parallel=auto: rank 0 published no plan within launcher.timeout_s={timeout_s:g} "
            "s; if planning this job takes longer (python -m hsdp_runner.plan times it), raise "
            "launcher.timeout_s"
        ) from None
    published = json.loads(store.get(key))
    if "error" in published:
        raise ConfigError(published["error"])
    return published


def submitted_job_dir(cfg: DictConfig, num: int) -> Path:
    """The output dir Hydra will give job ``num`` of a sweep (``hydra.sweep.dir`` /
    ``hydra.sweep.subdir``), for its composed config ``cfg``; ConfigError when the subdir uses
    ``hydra.job.id``, which is known only after submission."""
    with open_dict(cfg.hydra.job):
        cfg.hydra.job.num = num
        cfg.hydra.job.id = _UNKNOWN_JOB_ID
    subdir = str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
    if _UNKNOWN_JOB_ID in subdir:
        raise ConfigError(
            "parallel=auto with a SLURM launcher writes each job's plan into its dir before "
            "submitting, but hydra.sweep.subdir uses hydra.job.id, which SLURM assigns later; "
            "leave ${hydra.job.id} out of hydra.sweep.subdir"
        )
    return Path(str(cfg.hydra.sweep.dir)) / subdir
