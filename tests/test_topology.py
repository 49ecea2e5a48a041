"""The topology model in exact arithmetic: how groups sit on nodes (k ranks of a group per node,
groups per node), what a collective costs on NVLink and on the node's NICs, links shared by
collectives that run at once, and single-node prices unchanged by all of it."""

import pytest
from clusters import fake_cluster

from hsdp_runner import plan
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.comm_model import analytic_comm
from hsdp_runner.distributed.parallel_dims import DIM_NAMES, ParallelDims
from hsdp_runner.distributed.topology import (
    Placement,
    group_dims,
    mesh_groups,
    placement,
    placement_of_groups,
)
from hsdp_runner.planner.cluster import Cluster, resolve
from hsdp_runner.planner.step_time import comm_prices, concurrent_time, step_time

NAMES = ("dp_replicate", "dp_shard", "tp")  # the 3-D meshes below: the topology is generic


@pytest.mark.parametrize(
    "shape, node, name, expected",
    [
        # k = 8: FSDP over 4 nodes of 8; one group, all 8 GPUs of every node in it.
        ((1, 32, 1), 8, "dp_shard", Placement(32, 8, 1, 4)),
        # k = 1: HSDP's replicate groups, one rank per node, 8 of them on every node.
        ((4, 8, 1), 8, "dp_replicate", Placement(4, 1, 8, 4)),
        ((4, 8, 1), 8, "dp_shard", Placement(8, 8, 1, 1)),
        ((3, 8, 1), 8, "dp_replicate", Placement(3, 1, 8, 3)),  # 3 nodes
        # k = 2: the shard group strides over TP 4, so each node holds 2 ranks of 4 groups.
        ((1, 8, 4), 8, "dp_shard", Placement(8, 2, 4, 4)),
        ((1, 8, 4), 8, "tp", Placement(4, 4, 2, 1)),
        # k = 4: shard 8 over 2 nodes beside TP 2.
        ((1, 8, 2), 8, "dp_shard", Placement(8, 4, 2, 2)),
        # flattened dp and the world group of 2 nodes of 4 ranks.
        ((2, 2, 2), 4, "dp", Placement(4, 2, 2, 2)),
        ((2, 2, 2), 4, "world", Placement(8, 4, 1, 2)),
        # uneven: 3 ranks per node, shard 3 beside tp 2: groups {0,2,4} and {1,3,5}.
        ((1, 3, 2), 3, "dp_shard", Placement(3, 1, 2, 2)),
    ],
)
def test_placement_counts_ranks_per_node_and_groups_per_node(shape, node, name, expected):
    assert placement(shape, NAMES, name, node) == expected


@pytest.mark.parametrize(
    "shape, name, expected",
    [
        # The runner's 5-D mesh, 2 nodes of 4: FSDP over dp_shard x cp strides over tp 2.
        ((1, 1, 2, 2, 2), "dp_shard_cp", Placement(4, 2, 2, 2)),
        ((1, 1, 2, 2, 2), "cp", Placement(2, 2, 2, 1)),
        ((1, 2, 1, 2, 2), "dp_cp", Placement(4, 2, 2, 2)),
        # pp outermost: each stage's ranks on one node, the stages across the two.
        ((2, 1, 2, 1, 2), "pp", Placement(2, 1, 4, 2)),
    ],
)
def test_placement_of_context_parallel_groups(shape, name, expected):
    assert placement(shape, DIM_NAMES, name, 4) == expected


def test_mesh_groups_are_row_major_with_the_last_dim_innermost():
    assert mesh_groups((2, 2, 2), NAMES, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh_groups((2, 2, 2), NAMES, ("dp_replicate",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh_groups((2, 2, 2), NAMES, ("dp_replicate", "dp_shard")) == [
        [0, 2, 4, 6],
        [1, 3, 5, 7],
    ]


def test_placement_arithmetic_equals_counting_the_enumerated_groups():
    """Every mesh of up to 4 x 4 x 3 ranks, every node size dividing it, every group name."""
    import itertools

    for shape in itertools.product((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3)):
        world = shape[0] * shape[1] * shape[2]
        for node in (n for n in range(1, world + 1) if world % n == 0):
            for name in (*NAMES, "dp", "world"):
                groups = mesh_groups(shape, NAMES, group_dims(name, NAMES))
                expected = placement_of_groups(groups, {r: r // node for r in range(world)})
                assert placement(shape, NAMES, name, node) == expected, (shape, node, name)


def test_unknown_group_name_is_refused():
    with pytest.raises(ValueError, match="neither a mesh dim"):
        placement((2, 2, 2), NAMES, "pp", 4)


def _cluster(**kw) -> Cluster:
    """8 GPUs per node, NVLink 100 GB/s, 4 NICs of 80 Gb/s per node: 5 GB/s per GPU."""
    return fake_cluster(
        **{
            "device": "x",
            "gpus_per_node": 8,
            "nodes": 4,
            "nvlink_gbps": 125.0,
            "nvlink_efficiency": 0.8,
            **kw,
        }
    )


@pytest.mark.parametrize(
    "k, bus, link", [(1, 5.0, "nic"), (2, 10.0, "nic"), (4, 20.0, "nic"), (8, 40.0, "nic")]
)
def test_ring_across_nodes_gets_k_gpus_share_of_the_nics(k, bus, link):
    c = _cluster()
    where = Placement(size=4 * k, ranks_per_node=k, groups_per_node=8 // k, nodes=4)
    price = c.price("all_gather", where, calls=3, nbytes=8e9)
    ring = (4 * k - 1) / (4 * k)
    assert price.bus_gbps == bus and price.link == link and price.algorithm == "ring"
    assert price.latency_s == pytest.approx(3 * 20e-6, rel=1e-12)
    assert price.link_s["nic"] == pytest.approx(ring * 8e9 / (bus * 1e9), rel=1e-12)
    assert price.seconds == pytest.approx(3 * 20e-6 + ring * 8e9 / (bus * 1e9), rel=1e-12)
    # k > 1: the ring also crosses NVLink inside each node; k = 1 never touches it.
    assert ("nvlink" in price.link_s) == (k > 1)


def test_ring_across_nodes_is_capped_by_nvlink_and_all_reduce_moves_twice():
    c = _cluster(nics_per_node=8, nic_gbit=400.0, nic_efficiency=0.96)  # 48 GB/s per GPU
    where = Placement(16, 8, 1, 2)  # 8 x 48 > 100
    price = c.price("all_reduce", where, calls=1, nbytes=1e9)
    assert price.bus_gbps == 100.0 and price.link == "nvlink"
    assert price.bandwidth_s == pytest.approx(2 * 15 / 16 * 1e9 / 100e9, rel=1e-12)
    inside = c.price("reduce_scatter", Placement(8, 8, 1, 1), calls=2, nbytes=1e9)
    assert inside.link_s == {"nvlink": pytest.approx(7 / 8 * 1e9 / 100e9, rel=1e-12)}
    assert inside.latency_s == pytest.approx(2 * 10e-6)
    assert c.price("all_gather", Placement(1, 1, 8, 1), 5, 1e9).seconds == 0.0


def test_collectives_at_once_add_on_a_shared_link_and_overlap_on_separate_ones():
    c = _cluster()
    shard_in_node = c.price("reduce_scatter", Placement(8, 8, 1, 1), 1, 8e9)  # NVLink only
    replicate = c.price("all_reduce", Placement(4, 1, 8, 4), 1, 1e9)  # NICs only
    shard_across = c.price("reduce_scatter", Placement(32, 8, 1, 4), 1, 8e9)  # NICs + NVLink
    lat = shard_in_node.latency_s + replicate.latency_s
    assert concurrent_time([shard_in_node, replicate], [1.0, 1.0]) == pytest.approx(
        lat + max(shard_in_node.bandwidth_s, replicate.bandwidth_s), rel=1e-12
    )
    assert concurrent_time([shard_across, replicate], [1.0, 0.5]) == pytest.approx(
        shard_across.latency_s
        + 0.5 * replicate.latency_s
        + shard_across.link_s["nic"]
        + 0.5 * replicate.link_s["nic"],
        rel=1e-12,
    )


@pytest.fixture(scope="module")
def h100_4_nodes():
    """Llama 3 8B, bf16, batch 32 on 4 nodes of the h100_sxm preset: (config, Cluster)."""
    cfg = plan.compose(
        [
            "model=llama3_8b",
            "precision=bf16",
            "trainer.global_batch_size=32",
            "cluster=h100_sxm",
            "cluster.nodes=4",
        ]
    )
    return cfg, resolve(to_run_config(cfg).cluster, "bfloat16")


def test_hsdp_on_nodes_prices_its_terms_by_where_their_groups_sit(h100_4_nodes):
    cfg, cluster = h100_4_nodes
    dims = ParallelDims(dp_replicate=4, dp_shard=8, tp=1, world_size=32, ranks_per_node=8)
    comm = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    prices = comm_prices(comm, dims, cluster)
    # 8 NICs x 400 Gb/s x 0.96 / 8 GPUs = 48 GB/s for the replicate ring (k = 1).
    assert prices["all_reduce/dp_replicate"].bus_gbps == pytest.approx(48.0)
    assert prices["reduce_scatter/dp_shard"].bus_gbps == pytest.approx(360.0)
    facts = step_time(cfg, dims, cluster)["comm_links"]["all_reduce/dp_replicate"]
    assert (
        facts["size"],
        facts["ranks_per_node"],
        facts["groups_per_node"],
        facts["nodes"],
        facts["link"],
    ) == (4, 1, 8, 4, "nic")


def test_full_sharding_over_nodes_uses_every_nic_of_the_node_not_one(h100_4_nodes):
    """FSDP over 32 GPUs of 4 nodes: the ring's 8 ranks per node use the node's 8 NICs (bus
    bandwidth NVLink-bound, 360 GB/s), not one GPU's 48 GB/s."""
    cfg, cluster = h100_4_nodes
    dims = ParallelDims(dp_replicate=1, dp_shard=32, tp=1, world_size=32, ranks_per_node=8)
    comm = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    assert comm_prices(comm, dims, cluster)["all_gather/dp_shard"].bus_gbps == 360.0


# step_time_s of llama3_debug (batch 8) on 8 ranks of one node with a measured link table,
# computed by the planner before links were priced by topology (commit 382ece3): single-node
# prices on this machine must not move.
# Re-taken 2026-11-25 when compute began to include the work between matmuls at memory
# bandwidth (planner/precision_cost.py: ~0.105 s of this CPU cluster's 5 GB/s per step here);
# what the topology model prices is unchanged. Re-taken 2026-11-26 when the comm model began
# counting the grad clip's all-reduce of the gradients' norms (comm_model._clip_norm): one
# small all-reduce over each dim a gradient is sharded on, exposed, its latency (0.4-1.0 ms).
# Re-taken 2026-11-27 when the clip's norm began to ride in the step's stats all-reduce
# (train/grad_clip.py): those latencies gone again (0.4-1.0 ms less where a gradient was
# sharded on a dim the stats' group is not).
# Re-taken the same day when RMSNorm stopped moving fp32 copies of its input (models/common.py;
# the work between matmuls priced at memory bandwidth: 7.1 ms less a step here, 13.1 ms with
# full AC): every layout by the same amount, what the topology model prices unchanged.
# Re-taken the same day when bf16 attention stopped copying grouped-query keys and values per
# query head (models/common.py ``grouped_kv``; the traffic trace follows it): 1.89 ms less a
# step here, 2.83 ms with full AC, every layout by the same amount.
# Re-taken the same day when RoPE became one product with each pair's rotation and one rounded
# sum (models/common.py ``RopeFunction``: four kernels a direction, not nine): 7.79 ms less a
# step here, 11.68 ms with full AC, every layout by the same amount.
BEFORE = {
    0.32: {
        "none:8x1x1": 2.221615787050307,
        "none:4x2x1": 2.212590242004303,
        "none:2x4x1": 2.2221236368285506,
        "none:1x8x1": 2.238835226477046,
        "none:4x1x2": 2.3033629782967484,
        "none:2x2x2": 2.302511169867746,
        "none:1x4x2": 2.3092704706382037,
        "none:2x1x4": 2.5891901841876677,
        "none:1x2x4": 2.591110359440893,
    },
    0.0: {
        "full:8x1x1": 3.065842700882051,
        "full:4x2x1": 3.0138775726769227,
        "full:2x4x1": 3.068938864984615,
        "full:1x8x1": 3.1635905162666664,
        "full:4x1x2": 3.06089667491282,
        "full:2x2x2": 3.0574043672205122,
        "full:1x4x2": 3.0959547672205123,
        "full:2x1x4": 3.3914852414153844,
        "full:1x2x4": 3.402750472184615,
    },
}


@pytest.mark.parametrize("overlap", [0.32, 0.0])
def test_single_node_prices_on_this_machine_are_unchanged(overlap):
    table = {
        k: {"2": [2e-4, 3e8], "4": [3e-4, 2e8], "8": [5e-4, 1.5e8]}
        for k in ("all_gather", "reduce_scatter", "all_reduce")
    }
    cluster = Cluster(
        name="m",
        device="cpu",
        gpus_per_node=8,
        nodes=1,
        device_memory_gib=2.0,
        peak_tflops=0.02,
        peak_source="t",
        compute_efficiency=0.5,
        nvlink_gbps=None,
        nvlink_efficiency=None,
        nics_per_node=None,
        nic_gbit=None,
        nic_efficiency=None,
        intra_node_latency_us=100.0,
        inter_node_latency_us=100.0,
        overlap=overlap,
        memory_reserve_gib=0.0,
        memory_gbps=5.0,
        measured_links=table,
        link_scale=1.3,
        latency_scale=2.0,
    )
    ac = next(iter(BEFORE[overlap])).split(":")[0]
    cfg = plan.compose(
        [
            "model=llama3_debug",
            "cluster=this_machine",
            f"parallel.ac={ac}",
            "trainer.global_batch_size=8",
            # The TP loss as it was when these were taken (its logits all-gathered): what is
            # checked is how the same communication is priced.
            "parallel.loss_parallel=false",
        ]
    )
    for key, before in BEFORE[overlap].items():
        rep, shard, tp = map(int, key.split(":")[1].split("x"))
        dims = ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, world_size=8, ranks_per_node=8)
        now = step_time(cfg, dims, cluster)
        # The step end is priced apart (test_plan); compute and communication are as before.
        assert now["step_time_s"] - now["step_end_s"] == pytest.approx(before, rel=1e-12), key
        assert now["step_end_s"] > 0


@pytest.mark.parametrize(
    "old, new",
    [("intra_node_gbps", "cluster.nvlink_gbps"), ("inter_node_gbps", "cluster.nics_per_node")],
)
def test_replaced_cluster_keys_fail_naming_the_new_ones(old, new):
    cfg = plan.compose(["cluster=a100_80gb", f"cluster.{old}=22.0"])
    with pytest.raises(ConfigError, match=f"cluster.{old} was replaced .*{new}"):
        resolve(to_run_config(cfg).cluster, "bfloat16")


def test_a_described_cluster_of_several_nodes_needs_its_nics():
    cfg = plan.compose(["cluster=h100_sxm", "cluster.nodes=2", "cluster.nics_per_node=null"])
    with pytest.raises(ConfigError, match="cluster.nics_per_node=None must be > 0"):
        resolve(to_run_config(cfg).cluster, "bfloat16")


def test_measured_machine_prices_groups_spanning_its_nodes_from_its_own_table():
    """Two torchrun agents on one machine are two "nodes" sharing its memory: a group spanning
    them is priced from the measured table like one inside a node."""
    table = {"all_gather": {"2": [1e-4, 2e8], "4": [2e-4, 1e8]}}
    c = _cluster(
        nvlink_gbps=None,
        nvlink_efficiency=None,
        nics_per_node=None,
        nic_gbit=None,
        nic_efficiency=None,
        measured_links=table,
    )
    across = c.price("all_gather", Placement(4, 2, 1, 2), calls=2, nbytes=4e8)
    inside = c.price("all_gather", Placement(4, 4, 1, 1), calls=2, nbytes=4e8)
    assert across == inside and across.link == "measured"
    assert across.seconds == pytest.approx(2 * 2e-4 + 3 / 4 * 4e8 / 1e8, rel=1e-12)
    with pytest.raises(ConfigError, match="has no reduce_scatter"):
        c.price("reduce_scatter", Placement(4, 4, 1, 1), calls=1, nbytes=1.0)


def test_published_figures_name_their_source_and_role():
    """Every figure benchmarks/plan_published.py compares with says where it comes from and
    whether it chose a constant (fitted, naming which) or chose nothing (held out)."""
    from pathlib import Path

    import yaml

    data = yaml.safe_load(
        (Path(__file__).parents[1] / "benchmarks" / "published_figures.yaml").read_text()
    )
    assert data["date_read"]
    cases = data["throughput"] + data["links"]
    for case in cases:
        assert case["source"] and case["table"] and case["setup"], case["id"]
        assert case["role"] in ("fitted", "held_out"), case["id"]
        assert ("fits" in case) == (case["role"] == "fitted"), case["id"]
    held = [c for c in data["throughput"] if c["role"] == "held_out"]
    fitted_clusters = {c["cluster"] for c in data["throughput"] if c["role"] == "fitted"}
    # Every multi-node figure is held out; single-node ones only where compile or float8 makes
    # them figures the fitted (eager bf16) ones are not, or on a cluster none of whose figures
    # is fitted (sm90's constant is chosen on this runner's own H200 job instead).
    assert held and all(
        c["nodes"] > 1
        or "parallel.compile=true" in c["overrides"]
        or c["cluster"] not in fitted_clusters
        for c in held
    ), [c["id"] for c in held]
    assert all(c["nodes"] == 1 for c in data["throughput"] if c["role"] == "fitted")
    assert "h100_sxm" not in fitted_clusters
