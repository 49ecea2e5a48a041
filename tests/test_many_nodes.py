"""Many nodes on one machine: two torchrun agents as two "nodes", the SLURM preset's sbatch
script (inspected, never submitted) and a run through submitit's local executor; the two
runs are parallel=auto jobs, planned once for every rank."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from clusters import this_machine_cache
from conftest import TINY, cli_env, read_job, run_cli
from omegaconf import OmegaConf
from wandb_records import read_run

from hsdp_runner.distributed.parallel_dims import VIEWS, ParallelDims
from hsdp_runner.planner.step_time import placement_of


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_torchrun_agents_form_one_auto_planned_hsdp_job_with_replicate_across_nodes(tmp_path):
    """parallel=auto with dp_replicate=2 kept: rank 0 alone plans dp_shard for 2 nodes x 2
    ranks (torchrun's world), and every rank of both agents runs its choice."""
    (tmp_path / "cache").mkdir()
    # torchrun gives each of several workers 1 thread; the link table is for that.
    env = {**this_machine_cache(tmp_path / "cache", threads_per_rank=1), "OMP_NUM_THREADS": "1"}
    agent = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{free_port()}",
        "--rdzv-id",
        "two-nodes",
        "-m",
        "hsdp_runner",
        "parallel=auto",
        "parallel.dp_replicate=2",
        "parallel.cp=1",
        "parallel.tp=1",
        "logger=wandb",
        *[o for o in TINY if not o.startswith("logger=")],
    ]
    procs = [
        subprocess.Popen(
            agent,
            cwd=tmp_path,
            env=cli_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert [d.name for d in (tmp_path / "outputs" / "torchrun").iterdir()] == ["two-nodes"]
    job = tmp_path / "outputs" / "torchrun" / "two-nodes"
    records, summary = read_job(job)
    assert summary["status"] == "completed" and len(records) == 6
    assert (summary["world_size"], summary["nodes"], summary["ranks_per_node"]) == (4, 2, 2)
    assert summary["mesh_shape"] == [1, 2, 2, 1, 1]
    assert summary["dims_across_nodes"] == ["dp_replicate"]
    # Read from the real process groups and each agent's node rank: how every dim's groups sit
    # on the two nodes is exactly what the planner's arithmetic prices.
    observed = summary["mesh_placement"]
    assert set(observed) == {*summary["mesh_dim_names"], *VIEWS}
    planned = ParallelDims(
        **dict(zip(summary["mesh_dim_names"], summary["mesh_shape"])),
        world_size=summary["world_size"],
        ranks_per_node=summary["ranks_per_node"],
    )
    for name, facts in observed.items():
        assert facts == placement_of(planned, name).describe(), name
    assert observed["dp_replicate"] == {
        "size": 2,
        "ranks_per_node": 1,
        "groups_per_node": 2,
        "nodes": 2,
    }
    assert observed["dp"] == {"size": 4, "ranks_per_node": 2, "groups_per_node": 1, "nodes": 2}
    assert observed["dp_shard"] == {
        "size": 2,
        "ranks_per_node": 2,
        "groups_per_node": 1,
        "nodes": 1,
    }
    assert sorted(p.name for p in (job / "logs").iterdir()) == [f"rank{r}.log" for r in range(4)]
    assert len(list((job / "wandb").glob("offline-run-*"))) == 1  # rank 0 alone logs to W&B
    # Planned once, on rank 0, into the job's dir; every rank ran that choice.
    stdout = outputs[0][0] + outputs[1][0]
    assert stdout.count("hsdp_runner: parallel=auto chose dp_replicate=2 dp_shard=2") == 1, stdout
    for r in range(4):
        rank_log = (job / "logs" / f"rank{r}.log").read_text()
        mesh = "mesh {'pp': 1, 'dp_replicate': 2, 'dp_shard': 2, 'cp': 1, 'tp': 1}"
        assert mesh in rank_log, r
    plan = json.loads((job / "plan" / "plan.json").read_text())
    assert plan["cluster"]["nodes"] == 2 and plan["cluster"]["gpus_per_node"] == 2
    assert OmegaConf.load(job / "config_resolved.yaml").plan.source == str(
        job / "plan" / "plan.json"
    )
    pred = summary["prediction"]
    assert pred["rank"] == 1 and pred["runner_up"] is None  # the one layout the degrees allow
    assert pred["figures"]["step_time_s"]["measured"] == summary["median_step_time_s"]
    run = read_run(next(job.glob("wandb/offline-run-*/run-*.wandb")))
    assert (
        run["summary"]["prediction/step_time_s/predicted"]
        == pred["figures"]["step_time_s"]["predicted"]
    )


@pytest.fixture
def fake_slurm(tmp_path) -> dict:
    """``sbatch`` and ``srun`` stand-ins on PATH: sbatch keeps the script and refuses the job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/bin/sh\ncp "$1" "$SBATCH_CAPTURE"\n'
        'echo "sbatch: test stand-in, nothing submitted" >&2\nexit 1\n'
    )
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{cli_env()['PATH']}",
        "SBATCH_CAPTURE": str(tmp_path / "submitted.sh"),
    }


SLURM_2x2 = [
    "launcher=slurm",
    "launcher.nnodes=2",
    "launcher.nproc_per_node=2",
    "launcher.partition=gpu",
    "launcher.account=proj",
    "launcher.timeout_min=30",
]


def test_slurm_sweep_becomes_one_job_array_with_a_task_per_rank(tmp_path, fake_slurm):
    result = run_cli(
        tmp_path,
        *SLURM_2x2,
        "parallel=hsdp,fsdp",
        *TINY,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        pin_dir=False,
        env=fake_slurm,
    )
    script = Path(fake_slurm["SBATCH_CAPTURE"]).read_text()
    for line in [
        "--nodes=2",
        "--ntasks-per-node=2",
        "--gpus-per-node=2",
        "--array=0-1%2",
        "--partition=gpu",
        "--account=proj",
        "--time=30",
        "--signal=USR2@120",
        "--cpus-per-task=8",
        "--mem=128GB",
    ]:  # 64 GB per GPU: SLURM's defaults (often 1 CPU) would starve it
        assert f"#SBATCH {line}\n" in script, script
    assert "srun " in script and "submitit.core._submit" in script
    # The fsdp job's shard group spans both nodes: warned about before submission.
    assert result.stderr.count("hsdp_runner: warning: parallel.dp_shard=4 spans nodes") == 1
    assert "nothing submitted" in result.stderr  # the stand-in refused; nothing else ran


def test_slurm_job_with_tp_across_nodes_is_refused_before_submission(tmp_path, fake_slurm):
    result = run_cli(
        tmp_path,
        *SLURM_2x2,
        "launcher.nproc_per_node=1",
        "parallel=tp",
        *TINY,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        pin_dir=False,
        env=fake_slurm,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "parallel.tp=2 spans nodes" in result.stderr
    assert "parallel.allow_tp_across_nodes=true" in result.stderr
    assert not Path(fake_slurm["SBATCH_CAPTURE"]).exists()


@pytest.mark.multiprocess
def test_auto_job_planned_before_submission_runs_as_two_submitit_tasks_in_one_dir(tmp_path):
    """parallel=auto under submitit's local executor: the submitting process plans (on
    cluster=this_machine, for launcher.nproc_per_node ranks) into the job's dir, and both
    tasks run that plan's choice without planning."""
    sweep = tmp_path / "sweep"
    (tmp_path / "cache").mkdir()
    result = run_cli(
        tmp_path,
        "launcher=slurm_local",
        "launcher.nproc_per_node=2",
        "parallel=auto",
        "parallel.cp=1",
        "parallel.tp=1",
        "cluster=this_machine",
        *TINY,
        f"hydra.sweep.dir={sweep}",
        pin_dir=False,
        cwd=tmp_path,
        env=this_machine_cache(tmp_path / "cache"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("hsdp_runner: parallel=auto chose ") == 1
    (job,) = [d for d in sweep.iterdir() if d.is_dir() and d.name != ".submitit"]
    records, summary = read_job(job)
    assert summary is not None, [p.read_text()[-2000:] for p in sweep.glob(".submitit/*/*.err")]
    assert summary["status"] == "completed" and len(records) == 6
    assert (summary["world_size"], summary["nodes"], summary["ranks_per_node"]) == (2, 1, 2)
    assert sorted(p.name for p in (job / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    plan = json.loads((job / "plan" / "plan.json").read_text())
    chosen = next(e for e in plan["layouts"] if e["valid"] and e["fits"])
    assert summary["dp_replicate"] * summary["dp_shard"] == 2
    for name in ("dp_replicate", "dp_shard", "cp", "tp"):
        assert summary[name] == chosen["overrides"][f"parallel.{name}"], name
    assert OmegaConf.load(job / "config_resolved.yaml").plan.source == str(
        job / "plan" / "plan.json"
    )
    pred = summary["prediction"]
    assert pred["rank"] == 1 and pred["runner_up"] is not None  # ddp and fsdp both fit
    assert pred["figures"]["mem_gib"]["predicted"] == chosen["mem_gib"]
    tasks = "".join(p.read_text() for p in sweep.glob(".submitit/*/*.out"))
    assert "parallel=auto chose" not in tasks and "planned before submission" in tasks
