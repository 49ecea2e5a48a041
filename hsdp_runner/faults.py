"""Failures on purpose (``fault.*``): how tests and users see the runner's failure handling.

The trainer calls ``inject_fault`` at the start of each step and the checkpointer while it
saves; neither needs to know the other.
"""

from __future__ import annotations

import os
import signal
import time


def inject_fault(fault_cfg, rank: int, step: int, phase: str = "step") -> bool:
    """Fail on purpose when ``fault.rank`` is this rank, ``fault.step`` this (1-based) step and
    ``fault.phase`` this phase ('step': its start; 'save': while its checkpoint is written).

    Returns True when the fault is ``nan``: the caller poisons this step's loss.
    """
    if fault_cfg.rank != rank or fault_cfg.step != step or fault_cfg.phase != phase:
        return False
    if fault_cfg.kind == "nan":
        return True
    if fault_cfg.kind == "hang":
        while True:  # never joins the next collective; the peers' timeout ends the job
            time.sleep(3600)
    if fault_cfg.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault_cfg.kind == "sigterm":  # as a scheduler would send it; the step goes on
        os.kill(os.getpid(), signal.SIGTERM)
        return False
    raise RuntimeError(f"injected fault (fault.kind=exception) on rank {rank} at step {step}"
                       + (" while saving its checkpoint" if phase == "save" else ""))
