"""Under torchrun the runner joins as a rank instead of starting workers, into one output dir."""

import sys

import pytest

from conftest import TINY, read_job, run_cli

pytestmark = pytest.mark.multiprocess


def test_torchrun_fsdp_trains_into_exactly_one_output_dir(tmp_path):
    # Two ranks: each torchrun rank composes the config itself, a full CLI start-up.
    prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    result = run_cli(tmp_path, "parallel=fsdp", "parallel.dp_shard=2", *TINY, prefix=prefix,
                     pin_dir=False, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    dirs = list((tmp_path / "outputs" / "torchrun").iterdir())
    assert len(dirs) == 1, dirs
    records, summary = read_job(dirs[0])
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert len(records) == 6
    assert sorted(p.name for p in (dirs[0] / "logs").iterdir()) == [f"rank{r}.log" for r in range(2)]
    assert not (tmp_path / "outputs").joinpath("2026").exists()
