"""NCCL failure semantics: the ``TORCH_NCCL_*`` settings ranks run with, and reading a dead
rank's real cause back when its launcher saw only a signal.

The settings (``nccl_failure_env``), chosen rather than inherited:
- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (torch's default today, stated so a torch upgrade
  cannot change it silently): a rank whose collective runs past ``launcher.timeout_s`` is taken
  down by NCCL's watchdog (SIGABRT). The alternative, ``2`` (abort the communicators, raise in
  Python), leaves a job hung whenever the main thread never touches the failed work again; a
  job that ends is worth more than a nicer exception.
- ``TORCH_NCCL_TRACE_BUFFER_SIZE=2000`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: the flight
  recorder keeps each rank's last 2000 collectives and dumps them when a collective times out,
  so the dump says which collective each rank was in and which rank never arrived;
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` puts the dumps in the job's ``logs/`` (torch's default is
  each node's own ``/tmp``).

A rank killed that way leaves its launcher only "Signal 6 (SIGABRT)". The watchdog wrote the
cause to the rank's stderr first, which is its ``logs/rank<N>.log`` (rank 0's goes to the
console); ``cause_from_log`` finds it there for the failure record.
"""

from __future__ import annotations

import re
from pathlib import Path

TRACE_BUFFER_ENTRIES = 2000
TRACE_PREFIX = "nccl_trace_rank_"

# Lines a dying rank's log may hold, most telling first.
_CAUSES = (
    re.compile(r"Watchdog caught collective operation timeout.*"),
    re.compile(r"(NCCL error|ncclRemoteError|ncclSystemError|ncclUnhandledCudaError|"
               r"ncclInternalError|ncclInvalidUsage).*"),
    re.compile(r"CUDA error: .*"),
    re.compile(r"(?<=what\(\):).*\S.*"),
    re.compile(r"Fatal Python error: .*"),
)
# torch's elastic failure record when the rank wrote no error file (killed, or died in C++).
_SIGNAL_ONLY = re.compile(r"^(Signal \d+ \(\w+\) received by PID \d+|exit code -?\d+|"
                          r"To enable traceback see: \S+)$")


def nccl_failure_env(log_dir: Path) -> dict[str, str]:
    """The ``TORCH_NCCL_*`` variables a rank sets before creating NCCL groups (see the module
    docstring); callers keep any the user already set. Takes the job's ``logs/`` dir."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
            "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_BUFFER_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(log_dir / TRACE_PREFIX)}


def signal_only(message: str) -> bool:
    """True when a failure record says only how the process died, not why."""
    return bool(_SIGNAL_ONLY.match(message.strip()))


def cause_from_log(log_dir: Path, rank: int, max_chars: int = 400) -> str | None:
    """Return the most telling cause line in ``logs/rank<rank>.log`` (a watchdog timeout, an
    NCCL or CUDA error, a C++ exception's ``what()``), plus the flight-recorder dump's path if
    there is one; None when the log holds no such line."""
    path = log_dir / f"rank{rank}.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    cause = None
    for pattern in _CAUSES:
        hits = [m.group(0).strip() for m in map(pattern.search, lines) if m]
        if hits:
            cause = hits[0][:max_chars]
            break
    if cause is None:
        return None
    dump = log_dir / f"{TRACE_PREFIX}{rank}"
    return f"{cause} (NCCL flight recorder dump: {dump})" if dump.exists() else cause


# What a rank's collective raises when a peer process is gone (gloo's TCP pair, NCCL).
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ncclRemoteError")
# How long such a rank lingers before it exits; see ``peer_lost``.
PEER_LOST_GRACE_S = 1.0


def peer_lost(err: BaseException) -> bool:
    """True when ``err`` says only that another rank went away. Such a rank waits
    ``PEER_LOST_GRACE_S`` before it exits: torch's agent names the first failed worker it
    notices, and that should be the rank that died, not the peer it took with it."""
    return bool(_PEER_LOST.search(str(err)))
