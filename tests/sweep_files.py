"""Run every ready sweep file of ``sweeps/`` through the runner's command-line entry point, one
after the other in this one process: ``python tests/sweep_files.py <out root> <sweep.yaml>...``.

Each sweep runs as ``python -m hsdp_runner --config-dir sweeps --config-name <stem> data=text
data.path=no_such_corpus.txt hydra.sweep.dir=<out root>/<stem>`` would (the same argv through
``app.main``: Hydra's multirun, our validation per job), with a corpus that does not exist, so
every job is composed and validated and none starts a worker. One process for all of them
pays Python's, torch's and Hydra's start-up once instead of once per sweep file. Prints one
JSON line: {stem: exit code}.

Hydra's basic sweeper composes every job of a batch once to check that its overrides are
legal, and its launcher then composes each again to run it: here the first is left out
(``Sweeper.validate_batch_is_legal``), a third of the time. A job whose overrides are not legal still
fails, at the launcher's composition, and fails the sweep.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run_sweep(sweep_file: Path, sweep_dir: Path) -> int:
    """Run the sweep of ``sweep_file`` into ``sweep_dir`` through ``app.main``; return its exit
    code. Clears what the entry point keeps per process first (Hydra's global instance, the
    task-started flag and the sweep's tally), as a fresh process would start."""
    from hydra.core.global_hydra import GlobalHydra

    from hsdp_runner.runtime import app, sweep

    GlobalHydra.instance().clear()
    app._state["task_started"] = False
    sweep._tally.update(sweep_dir=None, codes=[])
    sys.argv = [
        "hsdp_runner",
        "--config-dir",
        str(sweep_file.parent),
        "--config-name",
        sweep_file.stem,
        "data=text",
        "data.path=no_such_corpus.txt",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    return app.main()


def main() -> None:
    from hydra.plugins.sweeper import Sweeper

    import hsdp_runner.runtime.app  # noqa: F401  (what ``python -m hsdp_runner`` imports)
    from hsdp_runner.core.frozen_imports import freeze_imports

    freeze_imports()  # as ``python -m hsdp_runner`` does before its main

    # On the base class: Hydra's plugin scan loads the basic sweeper's module afresh.
    Sweeper.validate_batch_is_legal = lambda self, batch: None
    out_root = Path(sys.argv[1])
    codes = {Path(f).stem: run_sweep(Path(f), out_root / Path(f).stem) for f in sys.argv[2:]}
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
