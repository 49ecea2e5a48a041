"""Node-aware layout and the multi-node launch checks, without starting any process."""

import os
from types import SimpleNamespace as NS

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from test_config import CONF, compose

from hsdp_runner.config.checks import validate_config
from hsdp_runner.config.compose import default_run_dir, to_run_config
from hsdp_runner.config.schema import ParallelConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.runtime.app import torchrun_problem
from hsdp_runner.runtime.prelaunch import validate
from hsdp_runner.runtime.slurm import join_submitit_job

MODEL = NS(n_heads=16, n_kv_heads=8, seq_len=512)


def dims(shape, ranks_per_node, allow_tp=False):
    parallel = ParallelConfig(
        dp_replicate=shape[0], dp_shard=shape[1], tp=shape[2], allow_tp_across_nodes=allow_tp
    )
    world = shape[0] * shape[1] * shape[2]
    return ParallelDims.from_config(parallel, MODEL, world, ranks_per_node)


@pytest.mark.parametrize(
    "shape, per_node, crossing",
    [
        ((2, 4, 2), 8, ["dp_replicate"]),  # default HSDP+TP: shard x tp fill one node
        ((2, 2, 1), 2, ["dp_replicate"]),
        ((4, 2, 1), 4, ["dp_replicate"]),  # replicate groups {0,2,4,6} cross, shard stays
        ((2, 2, 2), 8, []),  # one node
        ((1, 4, 1), 2, ["dp_shard"]),  # FSDP over two nodes
        ((1, 3, 2), 3, ["dp_shard", "tp"]),  # tp=2 does not divide 3 ranks per node
    ],
)
def test_dims_across_nodes_follow_contiguous_rank_placement(shape, per_node, crossing):
    d = dims(shape, per_node, allow_tp=True)
    assert d.dims_across_nodes() == crossing
    facts = d.describe()
    assert facts["nodes"] == d.world_size // per_node and facts["ranks_per_node"] == per_node
    assert facts["dims_across_nodes"] == crossing


def test_default_hsdp_on_nodes_warns_about_nothing():
    assert dims((2, 4, 2), 8).node_warnings() == []


def test_shard_group_spanning_nodes_warns_naming_the_slow_link():
    (message,) = dims((1, 4, 1), 2).node_warnings()
    assert "parallel.dp_shard=4 spans nodes (2 nodes x 2 ranks per node)" in message
    assert "inter-node link" in message and "parallel.dp_replicate" in message


def test_tp_across_nodes_is_an_error_unless_allowed():
    with pytest.raises(ConfigError) as err:
        dims((1, 1, 4), 2)
    assert "parallel.tp=4 spans nodes" in str(err.value)
    assert "parallel.allow_tp_across_nodes=true" in str(err.value)
    (message,) = dims((1, 1, 4), 2, allow_tp=True).node_warnings()
    assert "parallel.tp=4 spans nodes" in message and "inter-node link" in message


def test_world_size_must_be_whole_nodes():
    with pytest.raises(ConfigError, match="world size 6 is not a multiple of the 4 ranks per node"):
        dims((1, 6, 1), 4)


def test_one_node_job_records_one_node():
    facts = ParallelDims.from_config(ParallelConfig(dp_replicate=2, dp_shard=2), None, 4).describe()
    assert (facts["nodes"], facts["ranks_per_node"], facts["dims_across_nodes"]) == (1, 4, [])


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["launcher=local", "launcher.nnodes=2"], "use torchrun on every node or launcher=slurm"),
        (
            ["launcher=slurm", "launcher.nproc_per_node=null"],
            "launcher=slurm needs launcher.nproc_per_node",
        ),
        (
            ["launcher=slurm", "launcher.nproc_per_node=4", "launcher.gpus_per_node=2"],
            "launcher.gpus_per_node=2 is less than launcher.nproc_per_node=4",
        ),
        (["launcher=slurm_local", "launcher.nnodes=2"], "local executor runs one node"),
    ],
)
def test_launcher_settings_are_checked_before_launch(overrides, words, tmp_path):
    with pytest.raises(ConfigError, match=words):
        validate(compose(overrides), tmp_path, submitting=True)


def test_slurm_preset_feeds_our_keys_to_the_submitit_launcher():
    compose([])  # registers the schemas and the run-dir resolver
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose(
            config_name="config",
            return_hydra_config=True,
            overrides=[
                "launcher=slurm",
                "launcher.nnodes=4",
                "launcher.nproc_per_node=8",
                "launcher.partition=gpu",
                "launcher.account=proj",
                "launcher.timeout_min=30",
            ],
        )
    validate_config(to_run_config(cfg))
    hl = cfg.hydra.launcher
    assert hl._target_.endswith("CheckedSlurmLauncher") and cfg.hydra.mode.name == "MULTIRUN"
    assert (hl.nodes, hl.tasks_per_node, hl.gpus_per_node) == (4, 8, 8)
    assert (hl.partition, hl.account, hl.timeout_min) == ("gpu", "proj", 30)


def test_multi_node_torchrun_needs_a_shared_run_id(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert "--rdzv-id" in torchrun_problem(False, default_run_dir())
    assert torchrun_problem(False, "/shared/runs/a") is None  # hydra.run.dir given
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    assert default_run_dir() == "outputs/torchrun/job42"
    assert torchrun_problem(False, default_run_dir()) is None
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert torchrun_problem(False, default_run_dir()) is None


def test_a_sweep_inside_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    assert "one torchrun per job" in torchrun_problem(True, "multirun/x")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert torchrun_problem(True, "multirun/x") is None


def test_slurm_task_becomes_a_rank_and_keeps_every_gpu(monkeypatch):
    slurm = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }
    # Stale values are overwritten (and restored by monkeypatch after the test).
    stale = dict.fromkeys(
        ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"],
        "stale",
    )
    for key, value in {**slurm, **stale}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_PORT")
    join_submitit_job("slurm")
    exported = {k: os.environ[k] for k in stale}
    assert exported["RANK"] == "5" and exported["WORLD_SIZE"] == "8"
    assert exported["LOCAL_RANK"] == "1" and exported["LOCAL_WORLD_SIZE"] == "4"
    assert exported["MASTER_ADDR"] == "gpu07" and 20000 <= int(exported["MASTER_PORT"]) <= 60000
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_slurm_launcher_outside_a_submitit_job_is_a_config_error(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    with pytest.raises(ConfigError, match="multirun"):
        join_submitit_job("slurm")
