"""hydra-submitit-launcher's SLURM and local launchers, checking every job before submitting.

``launcher=slurm`` and ``launcher=slurm_local`` point ``hydra.launcher._target_`` here. The only
change to the plugin: ``launch`` first composes each job's config and runs hsdp_runner's
pre-launch checks on it (``prelaunch.check_before_submit``), so a bad degree in one job of a sweep
fails in seconds on the login node instead of after a queue wait. The plugin has no hook for
this, and Hydra's ``on_multirun_start`` callback sees only the sweep's base config, not each
job's. Hydra instantiates launchers only from the ``hydra_plugins`` package, hence this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher


class _CheckBeforeSubmit:
    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        """Validate every job (exit 2 naming the bad one), then submit them as the plugin does."""
        from hsdp_runner.runtime.app import mark_jobs_submitted
        from hsdp_runner.runtime.prelaunch import check_before_submit

        check_before_submit(
            self.hydra_context.config_loader, self.config, job_overrides, initial_job_idx
        )
        mark_jobs_submitted()
        returns = super().launch(job_overrides, initial_job_idx)
        # Each job ran in its own processes; its exit code came back as the return value.
        from hydra.core.utils import JobStatus

        from hsdp_runner.runtime import sweep

        for job in returns:
            if job.status == JobStatus.COMPLETED and isinstance(job.return_value, int):
                sweep.note_job(str(self.config.hydra.sweep.dir), job.return_value)
        return returns


class CheckedSlurmLauncher(_CheckBeforeSubmit, SlurmLauncher):
    """SLURM: one sbatch job per run, a job array per sweep."""

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        """Fill in the memory per node (``launcher.mem_gb=null``), then check and submit."""
        from hsdp_runner.runtime.slurm import slurm_mem_gb

        if self.params.get("mem_gb") is None:
            self.params["mem_gb"] = slurm_mem_gb(self.config.launcher)
        return super().launch(job_overrides, initial_job_idx)


class CheckedLocalLauncher(_CheckBeforeSubmit, LocalLauncher):
    """submitit's local executor: the SLURM code path on one machine, without SLURM."""
