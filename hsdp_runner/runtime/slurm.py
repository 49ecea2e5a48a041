"""What the runner knows about SLURM and submitit, in one place.

``launcher=slurm`` (and ``slurm_local``, submitit's local executor) runs each job through
hydra-submitit-launcher: one sbatch job per run, one SLURM task per rank. This module holds
the runner's side of that contract:
- ``slurm_mem_gb``: the memory per node a job asks for when ``launcher.mem_gb`` is null (the
  launcher plugin, ``hydra_plugins/hsdp_runner_submitit``, fills it in before submitting);
- ``join_submitit_job``: in a task, export the torch.distributed variables from SLURM's with
  submitit's helper, so the task runs like a torchrun rank;
- ``requeue_if_asked``: rank 0 of a job stopped by the time-limit signal hands over to
  submitit's requeue handler (``launcher.requeue``).
The pre-submit check of every job of a sweep is ``prelaunch.check_before_submit``; the stop
signals themselves are ``signals``'.
"""

from __future__ import annotations

import logging
import os
import signal

from hsdp_runner.config.schema import LauncherConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.core.records import RunSummary
from hsdp_runner.runtime.signals import StopRequest, parse_signal

log = logging.getLogger("hsdp_runner")

# launcher=slurm with launcher.mem_gb=null asks for this much memory per GPU (per task on a CPU
# partition): rank 0 gathers the full state on the CPU for an HF export (fp32 8B: 32 GB).
SLURM_MEM_GB_PER_GPU = 64


def slurm_mem_gb(launcher: LauncherConfig) -> int:
    """Memory per node in GB that a SLURM job asks for (sbatch --mem): ``launcher.mem_gb``, or
    ``SLURM_MEM_GB_PER_GPU`` x GPUs per node (x tasks per node without GPUs)."""
    if launcher.mem_gb is not None:
        return launcher.mem_gb
    return SLURM_MEM_GB_PER_GPU * (launcher.gpus_per_node or launcher.nproc_per_node or 1)


def in_submitit_job() -> bool:
    """True in a task that submitit started (a SLURM job's, or its local executor's)."""
    return "SUBMITIT_EXECUTOR" in os.environ


def join_submitit_job(launcher_name: str) -> None:
    """Make this SLURM (or submitit-local) task a torch.distributed rank.

    Exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from
    the job's environment with submitit's helper; raises ConfigError outside a submitit job.
    """
    if not in_submitit_job():
        raise ConfigError(
            f"launcher={launcher_name} runs jobs through hydra-submitit-launcher, "
            "which Hydra uses only in multirun mode; drop hydra.mode=RUN / "
            "hydra/launcher overrides, or use launcher=local"
        )
    from submitit.helpers import TorchDistributedEnvironment

    # Every GPU of the node stays visible (the rank picks cuda:LOCAL_RANK). overwrite: a RANK
    # etc. inherited from the submitting shell is replaced (submitit keeps an inherited
    # MASTER_PORT on purpose).
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


def requeue_if_asked(launcher: LauncherConfig, stop: StopRequest, summary: RunSummary) -> None:
    """Under submitit with ``launcher.requeue`` > 0, rank 0 of a job stopped by the time-limit
    signal hands over to submitit's own handler (the one ``stop.install`` replaced), which
    records the job, requeues it and exits this process; the requeued job resumes from its
    checkpoint. A job stopped by SIGTERM/SIGINT (scancel, Ctrl-C) is not requeued."""
    if not launcher.requeue or not in_submitit_job() or int(os.environ["RANK"]) != 0:
        return
    from submitit import JobEnvironment

    time_limit = {signal.SIGUSR2, JobEnvironment._usr_sig()}
    if launcher.signal:
        time_limit.add(parse_signal(launcher.signal))
    handler = stop.previous.get(JobEnvironment._usr_sig())
    if stop.signum not in time_limit or not callable(handler):
        return
    log.warning(
        "%s after step %d: requeueing the job through submitit; it resumes from %s",
        summary.signal,
        summary.interrupted_at_step,
        summary.last_checkpoint,
    )
    try:
        handler(stop.signum, None)  # requeues and exits the process
    except Exception as err:  # e.g. submitit's "timed-out too many times"
        log.warning("not requeued: %s", err)
