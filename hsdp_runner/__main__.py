"""``python -m hsdp_runner [overrides]``: compose the Hydra config and run one job (or a sweep
with ``-m``). Exit codes: 0 success, 1 a rank failed, 2 a config error (nothing started)."""

from __future__ import annotations

import sys

from hsdp_runner.core.frozen_imports import freeze_imports, pause_collection

if __name__ == "__main__":
    pause_collection()  # until freeze_imports: the imports below find no garbage worth a pass
from hsdp_runner.runtime.app import main  # noqa: E402

if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
