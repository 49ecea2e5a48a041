"""NCCL failure semantics: the ``TORCH_NCCL_*`` settings ranks run with, and reading a dead
rank's real cause back when its launcher saw only a signal.

The settings (``nccl_failure_env``), chosen rather than inherited:
- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (torch's default today, stated so a torch upgrade
  cannot change it silently): a rank whose collective runs past ``launcher.timeout_s`` is taken
  down by NCCL's watchdog (SIGABRT). The alternative, ``2`` (abort the communicators, raise in
  Python), leaves a job hung whenever the main thread never touches the failed work again; a
  job that ends is worth more than a nicer exception. torch's elastic agent (torchrun, and the
  local launcher's) writes its own default, 1, into every worker's environment
  (``local_elastic_agent.py``), where a worker's ``setdefault`` cannot replace it: the local
  launcher sets 3 before its workers start (``launch.start_local_workers``); under torchrun
  the user exports it.
- ``TORCH_NCCL_TRACE_BUFFER_SIZE=2000`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: the flight
  recorder keeps each rank's last 2000 collectives and dumps them when a collective times out,
  so the dump says which collective each rank was in and which rank never arrived;
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` puts the dumps in the job's ``logs/`` (torch's default is
  each node's own ``/tmp``).

A rank killed that way leaves its launcher only "Signal 6 (SIGABRT)". The watchdog wrote the
cause to the rank's stderr first, which is its ``logs/rank<N>.log`` (rank 0's stderr goes
through its sidecar, ``sidecar.py``, to the console and ``logs/rank0.log``);
``cause_from_log`` finds it there for the failure record. Each rank opens its part of the log
with ``mark_attempt``, so a cause left by an earlier attempt in the same dir is never read.

This module is the one writer of failure records (a ``failed`` or stopped-at-once
``summary.json``). Who calls it: for a rank that died in C++, the local launcher
(``record_launcher_failure``); under torchrun / SLURM the first rank to fail in Python, which
names a peer that died before it (``record_rank_failure``), or rank 0's sidecar when rank 0
itself ends without a record (``record_if_missing``). ``record_end`` lets only the first
process of an attempt write.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from pathlib import Path

from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.records import SUMMARY_FILE, RunSummary

_ENDED_TOKEN = ".end_recorded"  # in logs/: this attempt's end is on record
TRACE_BUFFER_ENTRIES = 2000
# (variable, value): set by the local launcher before workers start, since torch's elastic
# agent overrides a worker's own; under torchrun the user exports it (docs/gpu.md).
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
TRACE_PREFIX = "nccl_trace_rank_"

# Lines a dying rank's log may hold, most telling first.
_CAUSES = (
    re.compile(r"Watchdog caught collective operation timeout.*"),
    re.compile(
        r"(NCCL error|ncclRemoteError|ncclSystemError|ncclUnhandledCudaError|"
        r"ncclInternalError|ncclInvalidUsage).*"
    ),
    re.compile(r"CUDA error: .*"),
    re.compile(r"(?<=what\(\):).*\S.*"),
    re.compile(r"Fatal Python error: .*"),
)
# faulthandler's first line when a fatal signal ends the process (worker.py enables it).
_FATAL_SIGNAL = re.compile(
    r"Fatal Python error: (Aborted|Segmentation fault|Bus error|"
    r"Floating-point exception|Illegal instruction)"
)
_ATTEMPT_MARK = "==== hsdp_runner: this attempt's log starts"
# A record of the runner's own logging (worker.setup_logging's format): it may quote another
# rank's cause ("rank 1 failed first: ..."), so it is never read as this rank's.
_OWN_RECORD = re.compile(r"^\[rank\d+\] \d\d:\d\d:\d\d [A-Z]+ ")
# torch's elastic failure record when the rank wrote no error file (killed, or died in C++).
_SIGNAL_ONLY = re.compile(
    r"^(Signal \d+ \(\w+\) received by PID \d+|exit code -?\d+|"
    r"To enable traceback see: \S+)$"
)


def nccl_failure_env(log_dir: Path) -> dict[str, str]:
    """The ``TORCH_NCCL_*`` variables a rank sets before creating NCCL groups (see the module
    docstring); callers keep any the user already set. Takes the job's ``logs/`` dir."""
    return {
        NCCL_ERROR_HANDLING[0]: NCCL_ERROR_HANDLING[1],
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_BUFFER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(log_dir / TRACE_PREFIX),
    }


def signal_only(message: str) -> bool:
    """True when a failure record says only how the process died, not why."""
    return bool(_SIGNAL_ONLY.match(message.strip()))


def mark_attempt(log_dir: Path, rank: int) -> None:
    """Open this attempt's part of ``logs/rank<rank>.log`` (the log is appended to across
    attempts); called by each rank before it writes anything there."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"rank{rank}.log", "a") as log:
        log.write(f"{_ATTEMPT_MARK} {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")


def _attempt_lines(path: Path, wait_s: float) -> list[str]:
    """The lines of the log at ``path`` written since its last ``mark_attempt`` (all of them
    in a log without one), less the runner's own log records; [] when there is no log.

    Rank 0's sidecar holds a lock on its log until it has copied all rank 0 wrote; wait up to
    ``wait_s`` for that lock, so a reader right after rank 0's death sees its last words.
    """
    try:
        with open(path, errors="replace") as log:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(log, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        break  # read what is there
                    time.sleep(0.05)
            text = log.read()
    except OSError:
        return []
    start = text.rfind(_ATTEMPT_MARK)
    return [
        line
        for line in (text[start:] if start >= 0 else text).splitlines()
        if not _OWN_RECORD.match(line)
    ]


def cause_from_log(
    log_dir: Path, rank: int, max_chars: int = 400, wait_s: float = 5.0
) -> str | None:
    """Return the most telling cause line in this attempt's part of ``logs/rank<rank>.log``
    (a watchdog timeout, an NCCL or CUDA error, a C++ exception's ``what()``), plus the
    flight-recorder dump's path if there is one; None when the log holds no such line.
    ``wait_s``: how long to wait for rank 0's sidecar to finish copying (see
    ``_attempt_lines``)."""
    return _cause(_attempt_lines(log_dir / f"rank{rank}.log", wait_s), log_dir, rank, max_chars)


def _cause(lines: list[str], log_dir: Path, rank: int, max_chars: int = 400) -> str | None:
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


def died_in_cpp(
    log_dir: Path, exclude: int | None = None, wait_s: float = 1.0
) -> tuple[int, str] | None:
    """Find a rank that died of a fatal signal in this attempt (``faulthandler`` wrote "Fatal
    Python error: Aborted" or the like to its log as it died): return (its rank, its cause),
    the earliest such log first; None when no rank's log says so. ``exclude``: the caller's
    own rank."""
    dead = []
    for path in log_dir.glob("rank*.log"):
        rank = path.stem.removeprefix("rank")
        if not rank.isdigit() or int(rank) == exclude:
            continue
        lines = _attempt_lines(path, wait_s)
        if any(_FATAL_SIGNAL.search(line) for line in lines):
            dead.append((path.stat().st_mtime, int(rank), _cause(lines, log_dir, int(rank))))
    if not dead:
        return None
    _, rank, cause = min(dead)
    return rank, cause


def first_failure(failures: dict) -> tuple[int, object]:
    """The (rank, failure) that started a job's failure, from torch's ``{rank: ProcessFailure}``.

    torch takes the smallest timestamp, in whole seconds. A rank killed by a signal is stamped
    when the agent noticed its death, later than the death, while its peers' errors ("Connection
    closed by peer") came after it and may carry an earlier second: such a rank within a second
    of the earliest stamp comes first.
    """
    earliest = min(f.timestamp for f in failures.values())
    killed = [
        r for r, f in sorted(failures.items()) if f.exitcode < 0 and f.timestamp <= earliest + 1
    ]
    rank = killed[0] if killed else min(failures, key=lambda r: failures[r].timestamp)
    return rank, failures[rank]


def with_timeout_hint(message: str) -> str:
    """``message``, plus what a collective timeout means when it mentions one."""
    if re.search(r"timed out|timeout", message, re.IGNORECASE):
        message += (
            " (a collective waited launcher.timeout_s without its peers: another rank "
            "hung or died; see the rank logs)"
        )
    return message


def failed_facts(log_dir: Path, rank: int, err: BaseException) -> dict:
    """The failure facts a rank whose Python code raised ``err`` records: ``status``,
    ``failed_rank``, ``error``. When a peer died in C++ before (NCCL's watchdog, a
    segfault), that peer is the failed rank and its cause the error: this rank's own error
    is then only the dead peer's echo ("Connection closed by peer", a timeout)."""
    found = died_in_cpp(log_dir, exclude=rank)
    if found is None:
        return {
            "status": RunStatus.failed,
            "failed_rank": rank,
            "error": f"{type(err).__name__}: {err}".strip(),
        }
    dead, cause = found
    error = with_timeout_hint(f"rank {dead} died in C++: {cause or 'no cause in its log'}")
    return {"status": RunStatus.failed, "failed_rank": dead, "error": error}


def begin_attempt(output_dir: str | Path) -> None:
    """Forget which rank recorded the end of a previous attempt in this dir (see
    ``record_end``); called once per job by the launching process (rank 0 under torchrun)
    before any rank starts."""
    (Path(output_dir) / "logs" / _ENDED_TOKEN).unlink(missing_ok=True)


def record_end(output_dir: str | Path, summary: RunSummary) -> bool:
    """Write ``summary`` (a failed or interrupted-at-once record) unless another process of
    this attempt already did: the first rank to fail names the failure (its peers fail after
    it, with "connection closed"). Returns whether it wrote."""
    logs = Path(output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(logs / _ENDED_TOKEN, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    summary.write(output_dir)
    return True


def end_recorded(output_dir: str | Path, since: float | None = None) -> bool:
    """Whether this attempt's end is on record: a failure through ``record_end`` or, with
    ``since`` (a ``time.time()``), a summary.json written since then (rank 0's completed or
    interrupted one)."""
    if (Path(output_dir) / "logs" / _ENDED_TOKEN).exists():
        return True
    try:
        return since is not None and (Path(output_dir) / SUMMARY_FILE).stat().st_mtime >= since
    except OSError:
        return False


def record_rank_failure(
    output_dir: str | Path, layout: dict, rank: int, err: BaseException, last_checkpoint: str | None
) -> RunSummary:
    """A rank whose Python code raised ``err``: record the job as failed (naming a peer that
    died in C++ first, see ``failed_facts``) unless a peer of this attempt recorded its end
    already. Takes the job dir, ``ParallelDims.describe()``, the rank, its error and the
    newest checkpoint; returns the summary this rank would write."""
    facts = failed_facts(Path(output_dir) / "logs", rank, err)
    summary = RunSummary.failed(
        layout, facts["failed_rank"], facts["error"], last_checkpoint=last_checkpoint
    )
    record_end(output_dir, summary)
    return summary


def record_stopped_at_once(
    output_dir: str | Path,
    layout: dict,
    signal: str,
    step: int,
    last_checkpoint: str | None,
    first_only: bool = True,
) -> RunSummary:
    """A repeated stop signal ended the job mid-step: record it as interrupted after ``step``
    (the last step in metrics.jsonl). ``first_only``: only if no process of this attempt
    recorded its end (a rank); False: replace summary.json (the launcher, after its ranks)."""
    summary = RunSummary.interrupted_at_once(layout, signal, step, last_checkpoint)
    if first_only:
        record_end(output_dir, summary)
    else:
        summary.write(output_dir)
    return summary


def record_launcher_failure(
    output_dir: str | Path, layout: dict, rank: int, message: str
) -> RunSummary:
    """The local launcher saw rank ``rank`` fail with ``message``: replace summary.json (figures
    of an earlier attempt must not appear under 'failed'); return the record."""
    summary = RunSummary.failed(layout, rank, message)
    summary.write(output_dir)
    return summary


def record_if_missing(output_dir: Path, layout: dict, started: float) -> RunSummary | None:
    """Rank 0 has died (rank 0's sidecar calls this): unless this attempt's end is on record
    since ``started``, write a failed summary naming the rank whose log holds a cause (rank 0
    first) and return it; else None."""
    if end_recorded(output_dir, since=started):
        return None
    logs = output_dir / "logs"
    rank, cause = 0, cause_from_log(logs, 0, wait_s=0)
    if cause is None and (found := died_in_cpp(logs, exclude=0, wait_s=0)) is not None:
        rank, cause = found
    error = (
        with_timeout_hint(f"rank {rank} died in C++: {cause}")
        if cause
        else (
            "rank 0 ended without recording why (killed by a signal it could not handle, e.g. "
            "its launcher's SIGKILL after a shutdown timeout); no cause in logs/rank*.log"
        )
    )
    summary = RunSummary.failed(layout, rank, error)
    return summary if record_end(output_dir, summary) else None
