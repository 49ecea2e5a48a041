"""How long torch's elastic launcher lets a failed job's other workers stop before it kills them.

When a worker fails, torch 2.13's launcher ends the others through
``torch.multiprocessing.ProcessContext.join()`` without a grace period, which sends SIGTERM and
waits a fixed 30 s before SIGKILL (``spawn.py``; the elastic agent's ``shutdown_timeout`` is
used only when the agent itself is signalled). A worker left when a peer failed is either
leaving already (its collectives fail with the peer's connection) or blocked in a collective
that will never complete, and one still running once the collective timeout has passed will
not stop. So the launcher passes a grace period of ``min(launcher.timeout_s, 15 s)``
(``stopping_failed_workers_within``): torch waits that long for the workers to end by
themselves, then that long again after SIGTERM, never longer in all than its own 30 s.
"""

from __future__ import annotations

import contextlib

# torch waits a grace period before SIGTERM and another after it; two of these are its 30 s.
MAX_GRACE_S = 15


@contextlib.contextmanager
def stopping_failed_workers_within(seconds: float):
    """Within it, when one of torch's worker processes fails, the others get a grace period
    of ``min(seconds, 15)`` to end by themselves and as long again after SIGTERM before
    SIGKILL. torch has no setting for it, so ``ProcessContext.join`` is wrapped to pass the
    grace period where its caller gives none, and put back after."""
    from torch.multiprocessing.spawn import ProcessContext

    original = ProcessContext.__dict__["join"]
    grace = min(seconds, MAX_GRACE_S)

    def join(self, timeout=None, grace_period=None):
        return original(self, timeout, grace if grace_period is None else grace_period)

    ProcessContext.join = join
    try:
        yield
    finally:
        ProcessContext.join = original
