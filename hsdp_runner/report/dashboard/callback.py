"""The Hydra callback that keeps a running sweep's ``compare.html`` up to date.

Configured in ``conf/config.yaml`` (``hydra.callbacks.dashboard``). In a multirun it
- at the start: marks the sweep running, writes a first (empty) page and prints where it is;
- after every job: rewrites the page from the job dirs as they are now;
- at the end (or at exit, when an interrupt ends the sweep early): marks the sweep finished
  and writes the final page, which no longer reloads itself.
Single runs are left alone. A dashboard that cannot be written is a warning, never an error:
the sweep must go on. With hydra-submitit-launcher the jobs run in other processes (other
nodes); there only a job's global rank 0 rewrites the page, and only where the sweep dir
is shared (it is, for the jobs to write their outputs there).
"""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class DashboardCallback(Callback):
    """Rewrites ``<sweep dir>/compare.html`` as a multirun's jobs finish (see the module doc).

    ``enable``: false turns it off; ``reload_s``: how often the open page reloads itself
    while the sweep runs.
    """

    def __init__(self, enable: bool = True, reload_s: int = 10):
        self.enable, self.reload_s = enable, int(reload_s)
        self._sweep_dir: Path | None = None
        self._owner_pid: int | None = None
        self._finished = False

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if not self.enable:
            return
        self._sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        self._owner_pid = os.getpid()
        atexit.register(self._finish)
        if self._guard("start", self._start):
            print(
                f"hsdp_runner: live dashboard: {self._sweep_dir / 'compare.html'} (open it "
                f"in a browser; rewritten after every job, reloads itself every "
                f"{self.reload_s} s until the sweep ends)",
                flush=True,
            )

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        if not self.enable or self._sweep_dir is None:
            return
        if os.getpid() != self._owner_pid and not _submitit_rank_zero():
            return
        from hsdp_runner.report.dashboard import page as dashboard_page

        self._guard(
            "update",
            lambda: dashboard_page.refresh(self._sweep_dir, live=True, reload_s=self.reload_s),
        )

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._finish()

    def _start(self) -> None:
        from hsdp_runner.report.dashboard import page as dashboard_page

        self._sweep_dir.mkdir(parents=True, exist_ok=True)
        dashboard_page.mark_sweep(self._sweep_dir, running=True)
        dashboard_page.refresh(self._sweep_dir, live=True, reload_s=self.reload_s)

    def _finish(self) -> None:
        """Mark the sweep finished and write the final page, once, in the launching process."""
        if not self.enable or self._finished or os.getpid() != self._owner_pid:
            return
        self._finished = True
        from hsdp_runner.report.dashboard import page as dashboard_page

        def finish() -> None:
            dashboard_page.mark_sweep(self._sweep_dir, running=False)
            path = dashboard_page.refresh(self._sweep_dir, live=False, reload_s=self.reload_s)
            print(f"hsdp_runner: dashboard: {path}", flush=True)

        self._guard("final", finish)

    def _guard(self, what: str, action) -> bool:
        try:
            action()
            return True
        except Exception as err:  # the dashboard must never stop or fail a sweep
            log.warning(
                "the %s dashboard in %s could not be written (%s: %s); the sweep goes "
                "on; `python -m hsdp_runner.compare %s` writes it later",
                what,
                self._sweep_dir,
                type(err).__name__,
                err,
                self._sweep_dir,
            )
            return False


def _submitit_rank_zero() -> bool:
    """True inside a hydra-submitit-launcher task of global rank 0 (False outside submitit)."""
    try:
        import submitit

        return submitit.JobEnvironment().global_rank == 0
    except Exception:  # not a submitit job, or submitit absent
        return False
