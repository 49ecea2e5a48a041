"""A multirun's bookkeeping: the tally of its jobs' outcomes, and its exit code.

Hydra's basic sweeper has no filter for combinations that cannot run, and a job that raises
would end the whole multirun. So every job of a sweep goes through ``launch.run_job``, which
returns instead of raising: a combination that fails validation is *skipped* (nothing
started), a job whose ranks fail is *failed*, and the sweep goes on. ``launch`` writes both
kinds of ``summary.json`` record. Jobs run one after another in this process (Hydra's basic
launcher), so the tally lives here.

Exit code of a multirun: 1 if any job failed; else 2 if no job ran (every combination was
skipped, e.g. a typo that breaks them all); else 0. Skipped jobs alone never make it non-zero.
A job stopped by a signal (128 + signal) makes that the multirun's code.
"""

from __future__ import annotations

from hsdp_runner.core.choices import RunStatus
from hsdp_runner.core.exit_codes import EXIT_CONFIG, EXIT_FAILED, EXIT_OK

STATUS = {
    EXIT_OK: RunStatus.completed,
    EXIT_FAILED: RunStatus.failed,
    EXIT_CONFIG: RunStatus.skipped,
}

_tally: dict = {"sweep_dir": None, "codes": []}


def note_job(sweep_dir: str, code: int) -> None:
    """Count one finished job of the sweep in ``sweep_dir`` by its exit code (0, 1 or 2)."""
    _tally["sweep_dir"] = sweep_dir
    _tally["codes"].append(code)


def ran() -> bool:
    """True once a multirun job has been counted in this process."""
    return bool(_tally["codes"])


def exit_code(codes: list[int]) -> int:
    """The multirun's exit code from its jobs' codes (see the module docstring)."""
    interrupted = [code for code in codes if code > 128]
    if interrupted:
        return interrupted[0]
    if EXIT_FAILED in codes:
        return EXIT_FAILED
    return EXIT_OK if EXIT_OK in codes else EXIT_CONFIG


def finish() -> int:
    """Print the sweep's tally and where its results are; return the multirun's exit code."""
    codes, sweep_dir = _tally["codes"], _tally["sweep_dir"]
    counts = ", ".join(f"{codes.count(code)} {name}" for code, name in STATUS.items())
    if any(code > 128 for code in codes):
        counts += f", {sum(code > 128 for code in codes)} {RunStatus.interrupted}"
    print(
        f"hsdp_runner: sweep done ({len(codes)} jobs: {counts}); results in {sweep_dir}\n"
        f"compare them: python -m hsdp_runner.compare {sweep_dir}"
    )
    return exit_code(codes)
