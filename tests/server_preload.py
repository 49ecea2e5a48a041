"""Imported by the test processes' forkserver (conftest's ``pytest_configure``), once, for every
rank it forks: what the suite's jobs import beyond the runner's own server, as a launcher that
had run every kind of job would have it (``launch.job_imports``).

- torchao's float8, quietly, as a float8 job's launcher imports it in its checks;
- the test modules' own imports: a rank started by ``run_workers`` unpickles its function by
  importing the test module, which imports pytest, conftest and the worker helpers (~0.08
  CPU-s a rank).
"""

import conftest  # noqa: F401
import distributed  # noqa: F401
import pytest  # noqa: F401

from hsdp_runner.distributed import float8

float8.torchao_float8()
