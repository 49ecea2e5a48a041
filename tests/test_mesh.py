"""ParallelDims: degree inference and every validation error, before any process starts."""

from types import SimpleNamespace as NS

import pytest

from hsdp_runner.config.schema import ParallelConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.parallel_dims import DIM_NAMES, ParallelDims, infer_world_size
from hsdp_runner.distributed.topology import placement

MODEL = NS(n_heads=16, n_kv_heads=8, seq_len=512)


def parallel(r=1, s=1, t=1, sp=True, cp=1, **allow):
    return ParallelConfig(dp_replicate=r, dp_shard=s, cp=cp, tp=t, sequence_parallel=sp, **allow)


@pytest.mark.parametrize(
    "degrees, world, expected",
    [
        ((1, -1, 1), 4, (1, 4, 1)),
        ((2, -1, 1), 8, (2, 4, 1)),
        ((-1, 2, 2), 8, (2, 2, 2)),
        ((1, 1, -1), 2, (1, 1, 2)),
        ((1, 1, 1), 1, (1, 1, 1)),
    ],
)
def test_minus_one_is_inferred_from_world_size(degrees, world, expected):
    dims = ParallelDims.from_config(parallel(*degrees), MODEL, world)
    assert dims.shape == (1, expected[0], expected[1], 1, expected[2])
    assert dims.dp == expected[0] * expected[1]


@pytest.mark.parametrize(
    "degrees, mode, layout",
    [
        ((1, 1, 1), "none", "single"),
        ((2, 1, 1), "ddp", "ddp"),
        ((1, 4, 1), "fsdp", "fsdp"),
        ((2, 2, 1), "hsdp", "hsdp"),
        ((1, 1, 2), "none", "tp"),
        ((1, 2, 2), "fsdp", "fsdp_tp"),
        ((2, 2, 2), "hsdp", "hsdp_tp"),
        ((2, 1, 2), "ddp", "ddp_tp"),
    ],
)
def test_ddp_fsdp_hsdp_are_two_degrees(degrees, mode, layout):
    dims = ParallelDims.from_config(parallel(*degrees), MODEL, degrees[0] * degrees[1] * degrees[2])
    assert (dims.dp_mode, dims.layout) == (mode, layout)


@pytest.mark.parametrize(
    "degrees, world, words",
    [
        ((2, 2, 1), 8, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "world size is 8", "-1"]),
        ((0, 1, 1), 1, ["parallel.dp_replicate=0", "positive"]),
        ((1, -2, 1), 2, ["parallel.dp_shard=-2"]),
        ((-1, -1, 1), 4, ["parallel.dp_replicate and parallel.dp_shard are all -1"]),
        ((1, -1, 3), 4, ["parallel.dp_shard=-1 cannot be inferred", "not divisible"]),
        ((1, 1, 3), 3, ["parallel.tp=3 does not divide model.n_heads=16"]),
        ((2, 2, 2), 4, ["parallel.cp=1 x parallel.tp=2 = 8, but the world size is 4"]),
    ],
)
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
    assert facts["mesh_shape"] == [1, 2, 2, 1, 2]
    assert facts["mesh_dim_names"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert facts["world_size"] == 8 and facts["dp"] == 4 and facts["cp"] == 1


def cp_dims(r, s, cp, t, world=None, model=MODEL, node=None, **kw):
    world = world or r * s * cp * t
    return ParallelDims.from_config(parallel(r, s, t, cp=cp, **kw), model, world, node)


@pytest.mark.parametrize(
    "degrees, shape, views, mode, layout",
    [
        ((1, 1, 2, 1), (1, 1, 2, 1), (1, 2, 2), "fsdp", "fsdp_cp"),
        ((1, 2, 2, 1), (1, 2, 2, 1), (2, 4, 4), "fsdp", "fsdp_cp"),
        ((2, 1, 2, 2), (2, 1, 2, 2), (2, 2, 4), "hsdp", "hsdp_cp_tp"),
        ((1, -1, 2, 1), (1, 4, 2, 1), (4, 8, 8), "fsdp", "fsdp_cp"),
        ((1, 1, -1, 2), (1, 1, 4, 2), (1, 4, 4), "fsdp", "fsdp_cp_tp"),
    ],
)
def test_cp_is_a_dim_between_dp_shard_and_tp_and_fsdp_shards_over_dp_shard_cp(
    degrees, shape, views, mode, layout
):
    dims = cp_dims(*degrees, world=8 if -1 in degrees else None)
    assert dims.shape == (1, *shape)  # pp = 1 outermost
    assert (dims.dp, dims.dp_shard_cp, dims.dp_cp) == views
    assert (dims.dp_mode, dims.layout) == (mode, layout)
    assert [dims.group_size(n) for n in ("dp", "dp_shard_cp", "dp_cp")] == list(views)


def test_a_view_whose_other_dims_are_size_one_is_that_dims_group():
    # The communication counter and the analytic model report a group by its first name.
    assert cp_dims(1, 4, 1, 1).same_group("dp_shard_cp") == "dp_shard"
    assert cp_dims(2, 1, 2, 1).same_group("dp_shard_cp") == "cp"
    assert cp_dims(2, 1, 2, 1).same_group("dp_cp") == "dp_cp"
    assert cp_dims(1, 2, 2, 2).same_group("dp_cp") == "dp_shard_cp"
    assert cp_dims(2, 2, 1, 1).same_group("dp_cp") == "dp"


def test_seq_len_must_split_into_two_chunks_per_cp_rank():
    model = NS(n_heads=16, n_kv_heads=8, seq_len=36)
    with pytest.raises(
        ConfigError,
        match=r"model.seq_len=36 is not divisible by 2 x "
        r"parallel.cp=4.*multiple of 8",
    ):
        cp_dims(1, 1, 4, 1, model=model)
    assert cp_dims(1, 1, 2, 1, model=model).cp == 2


def test_sequence_parallel_splits_each_cp_ranks_tokens_over_tp():
    model = NS(n_heads=16, n_kv_heads=8, seq_len=24)  # 12 tokens per cp rank: not by 8
    with pytest.raises(
        ConfigError,
        match=r"model.seq_len=24 is not divisible by parallel.cp x "
        r"parallel.tp = 2 x 8",
    ):
        cp_dims(1, 1, 2, 8, model=model)
    assert cp_dims(1, 1, 2, 8, model=model, sp=False).tp == 8


def test_cp_across_nodes_is_refused_unless_allowed():
    with pytest.raises(
        ConfigError,
        match=r"parallel.cp=4 spans nodes \(2 nodes x 4 ranks per "
        r"node\).*allow_cp_across_nodes=true",
    ):
        cp_dims(1, 1, 4, 2, node=4)
    dims = cp_dims(1, 1, 4, 2, node=4, allow_cp_across_nodes=True)
    assert dims.dims_across_nodes() == ["cp"]
    assert any("parallel.cp=4 spans nodes" in w for w in dims.node_warnings())
    # Within a node: dp_shard x cp x tp = 8 per node, only the replicate dim crosses.
    inside = cp_dims(2, 2, 2, 2, node=8)
    assert inside.dims_across_nodes() == ["dp_replicate"]
    spans = {
        name: placement(inside.shape, DIM_NAMES, name, 8).spans_nodes
        for name in ("dp_shard_cp", "dp_cp")
    }
    assert spans == {"dp_shard_cp": False, "dp_cp": True}


def test_cp_defaults_to_one_when_a_config_predates_it():
    old = NS(dp_replicate=2, dp_shard=2, tp=1, sequence_parallel=True)
    assert ParallelDims.from_config(old, MODEL, 4).shape == (1, 2, 2, 1, 1)
    launcher = NS(nnodes=1, nproc_per_node=None)
    assert infer_world_size(launcher, parallel(1, 2, 2, cp=2), device_count=0) == 8
