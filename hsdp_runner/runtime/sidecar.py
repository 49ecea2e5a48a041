"""Rank 0's sidecar: a small process that outlives rank 0 to keep its last words and its end.

Rank 0's stderr (file descriptor 2, so C++ messages too: NCCL's watchdog, ``terminate called
...``, faulthandler's stack) goes through a pipe to this process, which copies it to the
console and to ``logs/rank0.log``. A rank 0 aborted in C++ has written its cause into the pipe
before it died, so the cause reaches the log whatever killed the process; the other ranks log
to their files directly.

Under torchrun and SLURM no launcher of ours waits for the ranks, so the sidecar also writes
the failure record rank 0 could not: when rank 0 has ended and no end of this attempt was
recorded (neither a failure, nor rank 0's completed / interrupted summary), it writes
``status: failed`` with the cause found in the rank logs. Under the local launcher that record
is the launcher's (``launch._failure_message``), so the sidecar only copies. The record is
written by ``failures.record_if_missing``.

The sidecar imports no torch (it starts in a few tens of milliseconds), runs in its own
session and ignores stop signals (torchrun's agent kills each rank's process group; a
scheduler signals every process), and ends at the latest ``launcher.timeout_s`` after rank 0.
Why not coreutils ``tee``: a scheduler's SIGTERM would end it mid-job (and with it rank 0's
stderr), and it could neither tell readers when the copy is complete (the lock on the log)
nor write the failure record.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hsdp_runner.runtime.failures import record_if_missing

_STOP_WAIT_S = 5.0  # how long rank 0 waits for the sidecar to copy what it wrote
_CLEAN = b"clean"  # rank 0 -> sidecar on the control socket: it ends on its own
_ACK = b"copied"  # sidecar -> rank 0: everything rank 0 wrote is copied


class Sidecar:
    """Rank 0's handle on its running sidecar; ``stop()`` on every way out of Python."""

    def __init__(self, proc: subprocess.Popen, saved_stderr: int, control: socket.socket):
        self.proc = proc
        self._saved = saved_stderr
        self._control = control

    def stop(self) -> None:
        """Point fd 2 back at the original stderr, tell the sidecar that rank 0 ends on its own
        (its end is recorded) and wait until it has copied all rank 0 wrote. Safe to call
        twice."""
        if self._saved < 0:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._saved = -1
        try:
            self._control.settimeout(_STOP_WAIT_S)
            self._control.sendall(_CLEAN)
            self._control.recv(len(_ACK))
        except OSError:  # the sidecar is gone, or slow: nothing to wait for
            pass
        self._control.close()
        try:  # it ends at once unless a child of rank 0 still holds the pipe
            self.proc.wait(0.5)
        except subprocess.TimeoutExpired:
            pass


def start(output_dir: Path, layout: dict | None, timeout_s: float) -> Sidecar:
    """Start rank 0's sidecar and point this process's fd 2 at it.

    Takes the job's output dir, the layout facts for a failure record (``dims.describe()``;
    None when a local launcher of ours records failures) and ``launcher.timeout_s``. Returns
    the handle whose ``stop()`` restores fd 2.
    """
    read_end, write_end = os.pipe()
    # Not inherited by rank 0's own children: its end closes exactly when rank 0 ends.
    control, sidecar_end = socket.socketpair()
    spec = {
        "output_dir": str(output_dir),
        "layout": layout,
        "timeout_s": timeout_s,
        "started": time.time(),
        "control": sidecar_end.fileno(),
    }
    saved = os.dup(2)
    package_root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
    }
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsdp_runner.runtime.sidecar", json.dumps(spec)],
            stdin=read_end,
            stdout=saved,
            stderr=saved,
            pass_fds=(sidecar_end.fileno(),),
            env=env,
            start_new_session=True,
        )
    finally:
        os.close(read_end)
        sidecar_end.close()
    sys.stderr.flush()
    os.dup2(write_end, 2)
    os.close(write_end)
    return Sidecar(proc, saved, control)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # a closed console must not stop the copy to the log
        pass


def _copy_chunk(log_fd: int) -> bool:
    """Copy what stdin (rank 0's stderr pipe) holds to the log and stdout; False at EOF."""
    chunk = os.read(0, 1 << 16)
    if chunk:
        _write_all(log_fd, chunk)
        _write_all(1, chunk)
    return bool(chunk)


def _copy_until_rank0_ends(log_fd: int, control: socket.socket) -> tuple[bool, bool]:
    """Copy until rank 0 says it ends on its own or dies (its control socket closes), then
    what it left in the pipe. Returns (ended cleanly, pipe at EOF)."""
    at_eof, message = False, None
    while message is None:
        ready, _, _ = select.select([control] if at_eof else [0, control], [], [])
        if control in ready:
            message = control.recv(len(_CLEAN))
        if 0 in ready:
            at_eof = not _copy_chunk(log_fd)
    while not at_eof and select.select([0], [], [], 0)[0]:
        at_eof = not _copy_chunk(log_fd)
    return message == _CLEAN, at_eof


def _copy_rest(log_fd: int, timeout_s: float) -> None:
    """After rank 0: copy for its children still holding the pipe, until EOF or timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if select.select([0], [], [], left)[0] and not _copy_chunk(log_fd):
            return


def main(argv: list[str]) -> int:
    """The sidecar process: ``python -m hsdp_runner.runtime.sidecar '<json spec>'`` with rank
    0's stderr pipe as stdin and the original stderr as stdout (see ``start``)."""
    for sig in (
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
    ):
        signal.signal(sig, signal.SIG_IGN)
    spec = json.loads(argv[1])
    output_dir = Path(spec["output_dir"])
    control = socket.socket(fileno=spec["control"])
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    log_fd = os.open(
        output_dir / "logs" / "rank0.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    fcntl.flock(log_fd, fcntl.LOCK_EX)  # readers wait for the copy (failures._attempt_lines)
    clean, at_eof = _copy_until_rank0_ends(log_fd, control)
    fcntl.flock(log_fd, fcntl.LOCK_UN)
    if clean:
        control.sendall(_ACK)
    elif spec["layout"] is not None:
        summary = record_if_missing(output_dir, spec["layout"], spec["started"])
        if summary is not None:
            _write_all(
                1,
                f"hsdp_runner: rank {summary.failed_rank} failed: {summary.error}\n"
                f"rank logs: {output_dir / 'logs'}\n".encode(),
            )
    control.close()
    if not at_eof:
        _copy_rest(log_fd, spec["timeout_s"])
    os.close(log_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
