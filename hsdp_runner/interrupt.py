"""Stopping on SIGTERM / SIGINT (SLURM preemption, Ctrl-C) at a step boundary, on every rank.

A signal only sets a flag; after each step the ranks agree (one scalar all-reduce) whether
any of them was signalled, so all stop after the same step and can save one checkpoint
together. A second signal stops the process at once.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Install with ``install()``; ask ``agreed(device)`` after each step."""

    def __init__(self):
        self.signum: int | None = None

    def install(self) -> None:
        """Route SIGTERM and SIGINT of this process to the flag."""
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise SystemExit(128 + signum)
        self.signum = signum

    def agreed(self, device: torch.device) -> int | None:
        """Collective over the world: the signal number if any rank was signalled, else None."""
        flag = torch.tensor(float(self.signum or 0), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None


def signal_name(signum: int) -> str:
    """'SIGTERM' for 15, and so on."""
    return signal.Signals(signum).name
