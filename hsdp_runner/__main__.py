"""``python -m hsdp_runner [overrides]``: compose the Hydra config and run one job (or a sweep
with ``-m``). Exit codes: 0 success, 1 a rank failed, 2 a config error (nothing started)."""

from __future__ import annotations

import sys

from hsdp_runner.core.frozen_imports import freeze_imports
from hsdp_runner.runtime.app import main

if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
