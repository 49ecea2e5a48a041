"""How long torch's elastic launcher lets a failed job's other workers stop before it kills them.

When a worker fails, torch 2.13's launcher ends the others through
``torch.multiprocessing.ProcessContext.join()``: SIGTERM at once, then a fixed 30 s before
SIGKILL (``spawn.py``; the elastic agent's ``shutdown_timeout`` is used only when the agent
itself is signalled). A worker left when a peer failed is either leaving already (its
collectives fail with the peer's connection) or blocked in a collective that will never
complete, and one still running once the collective timeout has passed will not stop. So the
launcher caps that wait at ``launcher.timeout_s`` (``stopping_failed_workers_within``): never
longer than torch's 30 s, shorter when the collective timeout is.
"""

from __future__ import annotations

import contextlib

TORCH_WAIT_AFTER_SIGTERM_S = 30


@contextlib.contextmanager
def stopping_failed_workers_within(seconds: float):
    """Within it, when one of torch's worker processes fails, the others get at most
    ``seconds`` (and never more than torch's 30 s) between SIGTERM and SIGKILL. torch has no
    setting for it, so the wait of ``ProcessContext.join`` (its ``_join_procs_with_timeout``,
    called only on that path) is capped for the duration and put back after; a torch
    without that method is left as it is."""
    from torch.multiprocessing.spawn import ProcessContext

    original = ProcessContext.__dict__.get("_join_procs_with_timeout")
    if original is None:
        yield
        return
    cap = min(seconds, TORCH_WAIT_AFTER_SIGTERM_S)

    def _join_procs_with_timeout(self, timeout):
        return original(self, min(timeout, cap))

    ProcessContext._join_procs_with_timeout = _join_procs_with_timeout
    try:
        yield
    finally:
        ProcessContext._join_procs_with_timeout = original
