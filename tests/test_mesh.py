"""ParallelDims: degree inference and every validation error, before any process starts."""

from types import SimpleNamespace as NS

import pytest

from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.parallel_dims import ParallelDims, infer_world_size

MODEL = NS(n_heads=16, n_kv_heads=8, seq_len=512)


def parallel(r=1, s=1, t=1, sp=True):
    return NS(dp_replicate=r, dp_shard=s, tp=t, sequence_parallel=sp)


@pytest.mark.parametrize("degrees, world, expected", [
    ((1, -1, 1), 4, (1, 4, 1)),
    ((2, -1, 1), 8, (2, 4, 1)),
    ((-1, 2, 2), 8, (2, 2, 2)),
    ((1, 1, -1), 2, (1, 1, 2)),
    ((1, 1, 1), 1, (1, 1, 1)),
])
def test_minus_one_is_inferred_from_world_size(degrees, world, expected):
    dims = ParallelDims.from_config(parallel(*degrees), MODEL, world)
    assert dims.shape == expected
    assert dims.dp == expected[0] * expected[1]


@pytest.mark.parametrize("degrees, mode, layout", [
    ((1, 1, 1), "none", "single"), ((2, 1, 1), "ddp", "ddp"), ((1, 4, 1), "fsdp", "fsdp"),
    ((2, 2, 1), "hsdp", "hsdp"), ((1, 1, 2), "none", "tp"), ((1, 2, 2), "fsdp", "fsdp_tp"),
    ((2, 2, 2), "hsdp", "hsdp_tp"), ((2, 1, 2), "ddp", "ddp_tp"),
])
def test_ddp_fsdp_hsdp_are_two_degrees(degrees, mode, layout):
    dims = ParallelDims.from_config(parallel(*degrees), MODEL, degrees[0] * degrees[1] * degrees[2])
    assert (dims.dp_mode, dims.layout) == (mode, layout)


@pytest.mark.parametrize("degrees, world, words", [
    ((2, 2, 1), 8, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "world size is 8", "-1"]),
    ((0, 1, 1), 1, ["parallel.dp_replicate=0", "positive"]),
    ((1, -2, 1), 2, ["parallel.dp_shard=-2"]),
    ((-1, -1, 1), 4, ["parallel.dp_replicate and parallel.dp_shard are all -1"]),
    ((1, -1, 3), 4, ["parallel.dp_shard=-1 cannot be inferred", "not divisible"]),
    ((1, 1, 3), 3, ["parallel.tp=3 does not divide model.n_heads=16"]),
])
def test_bad_degrees_name_the_key_and_fix(degrees, world, words):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(parallel(*degrees), MODEL, world)
    for word in words:
        assert word in str(err.value)


def test_tp_must_divide_kv_heads():
    model = NS(n_heads=16, n_kv_heads=2, seq_len=512)
    with pytest.raises(ConfigError, match=r"parallel.tp=4 does not divide model.n_kv_heads=2"):
        ParallelDims.from_config(parallel(1, 1, 4), model, 4)


def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    model = NS(n_heads=16, n_kv_heads=16, seq_len=30)
    with pytest.raises(ConfigError, match=r"model.seq_len=30 is not divisible by parallel.tp=4"):
        ParallelDims.from_config(parallel(1, 1, 4), model, 4)
    dims = ParallelDims.from_config(parallel(1, 1, 4, sp=False), model, 4)
    assert dims.tp == 4


def test_world_size_defaults_to_degree_product_on_cpu_and_gpu_count_on_gpu():
    launcher = NS(nnodes=1, nproc_per_node=None)
    assert infer_world_size(launcher, parallel(2, 2, 2), device_count=0) == 8
    assert infer_world_size(launcher, parallel(1, -1, 1), device_count=8) == 8
    assert infer_world_size(NS(nnodes=2, nproc_per_node=4), parallel(1, -1, 1), 0) == 8
    with pytest.raises(ConfigError, match="launcher.nproc_per_node"):
        infer_world_size(launcher, parallel(1, -1, 1), device_count=0)


def test_describe_records_mesh_shape_and_names():
    facts = ParallelDims.from_config(parallel(2, 2, 2), MODEL, 8).describe()
    assert facts["mesh_shape"] == [2, 2, 2]
    assert facts["mesh_dim_names"] == ["dp_replicate", "dp_shard", "tp"]
    assert facts["world_size"] == 8 and facts["dp"] == 4
