"""Failures on purpose (``fault.*``): how tests and users see the runner's failure handling.

The trainer calls ``inject_fault`` at the start of each step and the checkpointer while it
saves; neither needs to know the other. ``FaultConfig``, the ``fault`` section's schema, lives
here rather than in ``config/schema.py`` (which includes it in ``RunConfig``): core sits below
config, and ``inject_fault`` reads it typed.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

from hsdp_runner.core.choices import FaultKind, FaultPhase


@dataclass
class FaultConfig:
    """``fault.*`` (conf/config.yaml): fail on purpose on rank ``rank`` (None: never) at 1-based step ``step``,
    in the way ``kind`` names (a ``FaultKind``) and ``phase`` ('step' or 'save')."""

    rank: Optional[int] = None
    step: int = 1
    # A str, checked against FaultKind in config/checks.py: Hydra's override parser reads
    # ``fault.kind=nan`` as a float, which an Enum field would reject.
    kind: str = FaultKind.exception.value
    phase: FaultPhase = FaultPhase.step


def _raise(rank: int, step: int, phase: FaultPhase) -> bool:
    raise RuntimeError(
        f"injected fault (fault.kind=exception) on rank {rank} at step {step}"
        + (" while saving its checkpoint" if phase == FaultPhase.save else "")
    )


def _hang(rank: int, step: int, phase: FaultPhase) -> bool:
    while True:  # never joins the next collective; the peers' timeout ends the job
        time.sleep(3600)


def _kill(rank: int, step: int, phase: FaultPhase) -> bool:
    os.kill(os.getpid(), signal.SIGKILL)
    return False


def _sigterm(rank: int, step: int, phase: FaultPhase) -> bool:
    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would send it; the step goes on
    return False


def _abort(rank: int, step: int, phase: FaultPhase) -> bool:
    _abort_like_nccl_watchdog(rank, step)
    return False


def _abort_like_nccl_watchdog(rank: int, step: int) -> None:
    """End this rank as NCCL's watchdog ends one whose collective timed out, with torch 2.13's
    wording: the cause written to stderr from C++ (file descriptor 2, unbuffered, not Python's
    ``sys.stderr``), then SIGABRT. On CPU this is the only way to see that path."""
    os.write(
        2,
        (
            f"[rank{rank}]:[E ProcessGroupNCCL.cpp:685] [Rank {rank}] Watchdog caught "
            f"collective operation timeout: WorkNCCL(SeqNum={step}, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=300000) ran for 300047 milliseconds before "
            "timing out (simulated by fault.kind=abort)\n"
        ).encode(),
    )
    os.abort()


# What each fault.kind does; True: the caller poisons this step's loss.
_FAULTS = {
    FaultKind.exception: _raise,
    FaultKind.hang: _hang,
    FaultKind.sigkill: _kill,
    FaultKind.sigterm: _sigterm,
    FaultKind.abort: _abort,
    FaultKind.nan: lambda rank, step, phase: True,
}


def inject_fault(
    fault: FaultConfig, rank: int, step: int, phase: FaultPhase = FaultPhase.step
) -> bool:
    """Fail on purpose when ``fault.rank`` is this rank, ``fault.step`` this (1-based) step and
    ``fault.phase`` this phase ('step': its start; 'save': while its checkpoint is written).

    Returns True when the fault is ``nan``: the caller poisons this step's loss.
    """
    if fault.rank != rank or fault.step != step or fault.phase != phase:
        return False
    return _FAULTS[FaultKind(fault.kind)](rank, step, phase)
