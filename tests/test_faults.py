"""Faults end a job in bounded time with a clear status: NaN, a hung rank, SIGTERM, no orphans.

Signals, hangs and kills run CLI jobs (the launcher's handling is what they prove); the NaN
jobs, a rank's own signal and the reruns that resume run through the runner's job path with
their ranks forked without torch's elastic launch (conftest's ``run_forked``)."""

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, TINY, cli_env, cli_server, rank_logs, read_job, run_forked

from hsdp_runner.runtime.signals import worker_pids

pytestmark = pytest.mark.multiprocess


def leftover_processes(marker: str, session: int | None = None) -> list[int]:
    """PIDs of live processes of a job: those whose environment carries ``marker`` (what the
    job started by exec, e.g. its sidecar) or, with ``session``, that are in that session
    (what it forked: a process forked without exec shows its ancestor's first environment in
    /proc, and a job started in a session of its own forks its launcher's forkserver and
    workers into it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
                elif session is not None and session_of(int(proc.name)) == session:
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def session_of(pid: int) -> int | None:
    """The session id of process ``pid`` (/proc/<pid>/stat), None when none has that pid."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def run_marked(job_dir, *overrides, timeout=240):
    """Run a job (its launcher forked from the CLI server, in a session of its own) to its end;
    return (its completed process, seconds, (its environment marker, its session), every
    process seen below the launcher while it ran: {(pid, start time): command line})."""
    marker = f"HSDP_TEST_JOB={uuid.uuid4().hex}"
    start = time.monotonic()
    proc = start_job(job_dir, *overrides, marker=marker.split("=")[1])
    seen = {}
    while proc.poll() is None:  # a process of the job may leave the launcher's tree (an
        # orphan): note it early
        for pid, cmdline in descendants(proc.pid):
            if (at := started(pid)) and cmdline:
                seen[pid, at] = cmdline.replace(b"\0", b" ")[:100].decode(errors="replace")
        if time.monotonic() - start > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.1)
    out, err = (job_dir.parent / name for name in ("stdout.txt", "stderr.txt"))
    result = subprocess.CompletedProcess(
        proc.args, proc.returncode, out.read_text(), err.read_text()
    )
    return result, time.monotonic() - start, (marker, proc.pid), seen


def started(pid: int) -> str | None:
    """Start time of process ``pid`` (/proc/<pid>/stat, a zombie's too), None when none has
    that pid: with the pid it names one process, even if the pid is used again."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def remaining(processes: dict[tuple[int, str], str]) -> list[str]:
    """Of ``processes`` ({(pid, start time): command line}), those that still exist in any
    state, zombies included, each as "pid (state, parent pid): command line"."""
    found = []
    for (pid, start), cmdline in processes.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[19] == start:
            found.append(f"{pid} ({fields[0]}, parent {fields[1]}): {cmdline}")
    return found


def test_nan_loss_stops_the_run_by_default(job_dir):
    result = run_forked(
        job_dir, *TINY, "parallel=fsdp", "fault.rank=1", "fault.step=3", "fault.kind=nan"
    )
    assert result.returncode == 1
    assert "step 3: loss nan" in result.stderr and "trainer.on_nan=skip" in result.stderr
    records, summary = read_job(job_dir)
    assert summary["status"] == "failed" and "not finite" in summary["error"]
    assert [r["step"] for r in records] == [1, 2]


def test_nan_step_is_skipped_and_counted_with_on_nan_skip(job_dir):
    result = run_forked(
        job_dir,
        *TINY,
        "parallel=fsdp",
        "fault.rank=1",
        "fault.step=3",
        "fault.kind=nan",
        "trainer.on_nan=skip",
        "metrics.memory_steps=1",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records, summary = read_job(job_dir)
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    assert summary["skipped_steps"] == 1 and summary["status"] == "completed"
    assert records[-1]["loss"] == records[-1]["loss"] and records[-1]["loss"] < records[0]["loss"]
    # Every rank measured the tensor memory its first steps added (the planner's measured
    # figure): more than the training state, less than the resident set grew, quietly.
    tensor_peaks = summary["mem_tensor_peak_gib_per_rank"]
    grown = [
        p - b
        for p, b in zip(summary["mem_peak_gib_per_rank"], summary["mem_baseline_gib_per_rank"])
    ]
    assert len(tensor_peaks) == len(grown) == 4
    assert all(summary["mem_estimate_gib"]["total"] < t < g for t, g in zip(tensor_peaks, grown))
    output = result.stderr + rank_logs(job_dir)  # the ranks' stderr is in their logs
    assert "USDT" not in output and "unknown size" not in output


def test_hung_rank_ends_the_job_through_the_collective_timeout(job_dir):
    result, seconds, marks, _ = run_marked(
        job_dir,
        *TINY,
        "parallel=hsdp",
        "fault.rank=3",
        "fault.step=2",
        "fault.kind=hang",
        "launcher.timeout_s=6",
    )
    assert result.returncode == 1
    assert "Timed out" in result.stderr and "launcher.timeout_s" in result.stderr
    # Start-up, the 6 s timeout, then SIGTERM and 6 s more (launcher.timeout_s, where torch
    # waits a fixed 30 s: agent_shutdown.py) before SIGKILL for the hung rank, which sleeps
    # on (a rank stuck in C++ would not even run a handler): ~20 s alone, ~45 s with torch's
    # wait. A job that waited for the hung rank would run into
    # run_marked's 240 s.
    assert seconds < 150
    _, summary = read_job(job_dir)
    assert summary["status"] == "failed" and "Timed out" in summary["error"]
    assert leftover_processes(*marks) == []


def test_sigkilled_rank_ends_the_job_and_leaves_no_orphans(job_dir):
    result, seconds, marks, processes = run_marked(
        job_dir, *TINY, "parallel=fsdp", "fault.rank=2", "fault.step=2", "fault.kind=sigkill"
    )
    assert result.returncode == 1 and "rank 2 failed" in result.stderr
    assert "Signal 9" in result.stderr
    assert leftover_processes(*marks) == []
    # The launcher reaped every process of the job before it exited: the four ranks, the
    # forkserver and multiprocessing's resource tracker, rank 0's sidecar; none is left, not
    # even as a zombie for init to reap.
    assert len(processes) >= 7
    assert remaining(processes) == []


# Stop signals, delivered the way they arrive in real life: the job runs in its own session
# (a terminal's foreground process group, a SLURM step), and a signal goes to every process of
# it (Ctrl-C, scancel), to the workers alone (`kill <pid of a rank>`) or to the launcher alone.


def start_job(job_dir: Path, *overrides: str, marker: str = "", prefix: list[str] | None = None):
    """Start ``python -m hsdp_runner`` in a new session (``prefix``: e.g. torchrun's command
    instead of python, started afresh; else forked from the CLI server, conftest's
    ``cli_server``, which runs the same command line in a process that imported the CLI
    once); output goes to files in the job's parent dir (a pipe nobody reads could block the
    job). Returns its ``subprocess.Popen`` or ``cli_forks.StartedCli`` (pid, poll, wait)."""
    job_dir.parent.mkdir(parents=True, exist_ok=True)
    env = cli_env({"HSDP_TEST_JOB": marker} if marker else None)
    args = [f"hydra.run.dir={job_dir}", *overrides]
    out, err = job_dir.parent / "stdout.txt", job_dir.parent / "stderr.txt"
    if prefix is None:
        return cli_server().start(args, env, REPO, out, err, new_session=True)
    return subprocess.Popen(
        [*prefix, "-m", "hsdp_runner", *args],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=open(out, "w"),
        stderr=open(err, "w"),
    )


def wait_for_steps(metrics: Path, steps: int, proc: subprocess.Popen, timeout: float = 180):
    """Return once ``metrics`` holds ``steps`` lines: looked at every 0.1 s until the job logs
    its first step, then every millisecond, so that a signal sent next lands within a step or
    two of ``steps`` (a tiny job's step takes 0.02-0.03 s here: looking every 0.1 s, with a
    late wake-up on the loaded machine, one job trained out its 16 steps first)."""
    deadline = time.monotonic() + timeout
    logged = 0
    while logged < steps:
        assert proc.poll() is None and time.monotonic() < deadline, "job ended or stalled"
        time.sleep(0.001 if logged else 0.1)
        logged = len(metrics.read_text().splitlines()) if metrics.exists() else 0


def finish(proc: subprocess.Popen, job_dir: Path, timeout: float = 120) -> tuple[int, str]:
    proc.wait(timeout=timeout)
    return proc.returncode, (job_dir.parent / "stderr.txt").read_text()


def parent_pid(pid: int) -> int:
    """The parent of live process ``pid`` (/proc/<pid>/stat)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def process_state(pid: int) -> str:
    """The state letter of live process ``pid`` (/proc/<pid>/stat: R, S, T stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def descendants(pid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of every live process below ``pid``, read from /proc."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            found.append((child, Path(f"/proc/{child}/cmdline").read_bytes()))
        except OSError:
            continue
        todo += children.get(child, [])
    return found


def signal_pids(pids: list[int], sig: int) -> None:
    assert pids
    for pid in pids:
        os.kill(pid, sig)


@contextlib.contextmanager
def paused(pids: list[int]):
    """Hold ``pids`` stopped (SIGSTOP) for the block, then let them go on (SIGCONT): a signal
    that a launcher or torch's agent passes on to its workers meanwhile is pending when they
    resume, so the workers cannot train out a tiny job's last steps while the process in the
    middle waits for a CPU on the loaded machine. The block starts once each one has stopped:
    a process not yet scheduled since the SIGSTOP would take a signal sent meanwhile first
    (the kernel hands out the lowest-numbered pending signal first: SIGINT before SIGSTOP), so
    that signal would be gone, not pending."""
    signal_pids(pids, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not all(process_state(pid) == "T" for pid in pids):
        assert time.monotonic() < deadline, f"{pids} never stopped"
        time.sleep(0.001)
    try:
        yield
    finally:
        signal_pids(pids, signal.SIGCONT)


def wait_pending(pids: list[int], sig: int, timeout: float = 60) -> None:
    """Wait until ``sig`` is pending for every one of ``pids`` (stopped processes: the
    process-wide pending mask of /proc/<pid>/status)."""
    deadline = time.monotonic() + timeout

    def pending(pid: int) -> bool:
        status = Path(f"/proc/{pid}/status").read_text()
        mask = next(line for line in status.splitlines() if line.startswith("ShdPnd:"))
        return bool(int(mask.split()[1], 16) >> (sig - 1) & 1)

    while not all(pending(pid) for pid in pids):
        assert time.monotonic() < deadline, f"signal {sig} never reached {pids}"
        time.sleep(0.05)


def steps_once(job_dir: Path, steps: int) -> bool:
    records, _ = read_job(job_dir)
    return [r["step"] for r in records] == list(range(1, steps + 1))


STEPS = 16  # a signal after step 3 stops the job long before its end (as in test_torchrun)
RUN = [*TINY, "parallel=ddp", f"trainer.steps={STEPS}", "checkpoint.enable=true"]


def test_sigint_twice_to_the_process_group_checkpoints_and_the_rerun_resumes_and_exports(tmp_path):
    # Ctrl-C: SIGINT to every process of the job, twice within milliseconds (each worker also
    # gets the launcher's forwarded copy). The unfinished run must not export hf/.
    job_dir = tmp_path / "job"
    run = [*RUN, "checkpoint.export_at_end=true", "checkpoint.export_dtype=float32"]
    proc = start_job(job_dir, *run)
    wait_for_steps(job_dir / "metrics.jsonl", 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    os.killpg(proc.pid, signal.SIGINT)
    code, stderr = finish(proc, job_dir)
    assert code == 128 + signal.SIGINT, stderr[-3000:]
    records, summary = read_job(job_dir)
    stopped = summary["interrupted_at_step"]
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT"
    assert 3 <= stopped < STEPS and steps_once(job_dir, stopped)
    assert summary["last_checkpoint"].endswith(f"step-{stopped}")
    assert not (job_dir / "hf").exists() and "rerun the same command to resume" in stderr

    rerun = run_forked(job_dir, *run)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _, summary = read_job(job_dir)
    assert summary["status"] == "completed" and summary["start_step"] == stopped
    assert steps_once(job_dir, STEPS) and (job_dir / "hf" / "config.json").is_file()


def test_sigterm_to_the_workers_only_stops_them_together_and_the_rerun_resumes(tmp_path):
    # `kill <pid of a rank>` or a scheduler signalling the ranks: the launcher sees nothing.
    job_dir = tmp_path / "job"
    proc = start_job(job_dir, *RUN, "launcher.timeout_s=60")
    wait_for_steps(job_dir / "metrics.jsonl", 3, proc)
    signal_pids(worker_pids(proc.pid), signal.SIGTERM)
    code, stderr = finish(proc, job_dir, timeout=60)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    _, summary = read_job(job_dir)
    stopped = summary["interrupted_at_step"]
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    assert summary["last_checkpoint"].endswith(f"step-{stopped}")

    rerun = run_forked(job_dir, *RUN)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _, summary = read_job(job_dir)
    assert summary["status"] == "completed" and summary["start_step"] == stopped
    assert steps_once(job_dir, STEPS)


def test_sigterm_to_the_launcher_only_reaches_the_workers(tmp_path):
    job_dir = tmp_path / "job"
    proc = start_job(job_dir, *RUN)
    wait_for_steps(job_dir / "metrics.jsonl", 3, proc)
    workers = worker_pids(proc.pid)
    with paused(workers):  # resumed once the launcher has passed the signal on to each
        os.kill(proc.pid, signal.SIGTERM)
        wait_pending(workers, signal.SIGTERM)
    code, stderr = finish(proc, job_dir)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    _, summary = read_job(job_dir)
    assert summary["status"] == "interrupted"
    assert summary["last_checkpoint"].endswith(f"step-{summary['interrupted_at_step']}")


def test_a_second_ctrl_c_two_seconds_later_stops_at_once_and_leaves_no_process(tmp_path):
    # Rank 1 hangs in step 4, so no step boundary comes; the user presses Ctrl-C again. (Step
    # 3's figures would be read once step 4's work is done, so metrics.jsonl ends at step 2.)
    job_dir = tmp_path / "job"
    marker = uuid.uuid4().hex
    proc = start_job(
        job_dir,
        *TINY,
        "parallel=ddp",
        "trainer.steps=30",
        "fault.rank=1",
        "fault.step=4",
        "fault.kind=hang",
        "launcher.timeout_s=120",
        marker=marker,
    )
    wait_for_steps(job_dir / "metrics.jsonl", 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(2)
    second = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    code, stderr = finish(proc, job_dir, timeout=60)
    assert time.monotonic() - second < 30
    assert code == 128 + signal.SIGINT, stderr[-3000:]
    assert "stopped at once" in stderr
    _, summary = read_job(job_dir)
    assert summary["status"] == "interrupted" and summary["stopped_at_once"] is True
    assert summary["interrupted_at_step"] == 2 and "final_loss" not in summary
    deadline = time.monotonic() + 10  # the resource tracker ends once its pipe closes
    while leftover_processes(f"HSDP_TEST_JOB={marker}", proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftover_processes(f"HSDP_TEST_JOB={marker}", proc.pid) == []


def test_a_signal_during_the_last_step_completes_the_job(job_dir):
    result = run_forked(
        job_dir,
        *TINY,
        "parallel=single",
        "trainer.steps=3",
        "checkpoint.enable=true",
        "fault.rank=0",
        "fault.step=3",
        "fault.kind=sigterm",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _, summary = read_job(job_dir)
    assert summary["status"] == "completed" and summary["last_checkpoint"].endswith("step-3")
    assert steps_once(job_dir, 3)


def test_slurm_time_limit_signal_to_every_task_checkpoints_and_requeues(tmp_path):
    # SLURM's --signal=USR2@120 reaches every task of the step; with launcher.requeue the job
    # goes back to the queue (submitit's local executor restarts it) and resumes.
    sweep = tmp_path / "sweep"
    proc = cli_server().start(
        [
            "launcher=slurm_local",
            "launcher.nproc_per_node=2",
            "launcher.requeue=1",
            "parallel=fsdp",
            "parallel.dp_shard=-1",
            *TINY,
            f"trainer.steps={STEPS}",
            "checkpoint.enable=true",
            f"hydra.sweep.dir={sweep}",
        ],
        cli_env(),
        tmp_path,
        tmp_path / "stdout.txt",
        tmp_path / "stderr.txt",
        new_session=True,
    )
    deadline = time.monotonic() + 180
    while not list(sweep.glob("*/metrics.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    (metrics,) = sweep.glob("*/metrics.jsonl")
    wait_for_steps(metrics, 3, proc)
    tasks = [pid for pid, cmd in descendants(proc.pid) if b"submitit.core._submit" in cmd]
    assert len(tasks) == 2
    signal_pids(tasks, signal.SIGUSR2)
    proc.wait(timeout=240)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 0, stderr[-3000:]
    job = metrics.parent
    _, summary = read_job(job)
    assert summary["status"] == "completed" and summary["start_step"] >= 3, summary
    assert steps_once(job, STEPS)
    assert "requeueing the job through submitit" in (job / "logs" / "rank0.log").read_text()
