"""The planner's step time for a model with experts, without processes: the token exchange's
all-to-all priced by where its group sits, the expert split's groups placed on the nodes, the
busiest rank's imbalance, and the experts' FSDP gathers hidden behind compute as the blocks'
are."""

import pytest
from clusters import fake_cluster

from hsdp_runner import plan
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.core.choices import ExchangeOrder
from hsdp_runner.distributed.moe_comm import expected_nodes
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.distributed.topology import Placement
from hsdp_runner.planner.step_time import fsdp_groups, placement_of, step_time

GB = 1e9


def test_an_all_to_all_across_nodes_sends_each_ranks_off_node_bytes_through_its_own_nic():
    """fake_cluster: NVLink 100 GB/s, 10 GB/s of NIC per GPU, 4 GPUs a node. Inside a node an
    all-to-all keeps 1/n of its input (like a ring's (n-1)/n, over NVLink); across 2 nodes with 4
    ranks of the group on each, half of a rank's bytes leave the node through its own NIC share
    (not 4 GPUs' as a ring's would), 3/8 go to its node's peers over NVLink at the same time."""
    cluster = fake_cluster()
    inside = cluster.price("all_to_all", Placement(4, 4, 1, 1), 1, 8 * GB)
    assert inside.link_s == {"nvlink": pytest.approx(6.0 / 100)}
    across = cluster.price("all_to_all", Placement(8, 4, 1, 2), 2, 8 * GB)
    assert across.link_s == {"nic": pytest.approx(4.0 / 10), "nvlink": pytest.approx(3.0 / 100)}
    assert across.latency_s == pytest.approx(2 * 20e-6) and across.algorithm == "all_to_all"
    ring = cluster.price("all_gather", Placement(8, 4, 1, 2), 2, 8 * GB)
    assert across.bandwidth_s > 2 * ring.bandwidth_s  # a ring spreads over 4 GPUs' NICs


def test_the_expert_split_sits_innermost_of_the_ranks_it_borrows():
    """16 ranks on 2 nodes of 8, FSDP 16 with ep 8: each ep group is 8 consecutive ranks (one
    node), each efsdp group 2 ranks 8 apart (one per node); with ep 16 the exchange crosses."""
    dims = ParallelDims(
        dp_replicate=1, dp_shard=16, cp=1, tp=1, world_size=16, ranks_per_node=8, ep=8, moe=True
    )
    assert placement_of(dims, "ep") == Placement(8, 8, 1, 1)
    assert placement_of(dims, "efsdp") == Placement(2, 1, 8, 2)
    wide = ParallelDims(
        dp_replicate=1, dp_shard=16, cp=1, tp=1, world_size=16, ranks_per_node=8, ep=16, moe=True
    )
    assert placement_of(wide, "ep") == Placement(16, 8, 1, 2)
    # Router and shared experts: over every rank of the replica, as the blocks are.
    assert placement_of(dims, "dp_shard_cp_tp") == placement_of(dims, "dp_shard")


MOE = ["model=moe_tiny", "model.dim=512", "model.expert_ffn_dim=512", "model.seq_len=256"]
MOE += ["model.n_experts=16", "trainer.global_batch_size=32", "precision=bf16"]


def _time(overrides: list[str], ep: int, shard: int = 8, **cluster) -> dict:
    cfg = to_run_config(plan.compose(MOE + overrides))
    dims = ParallelDims.from_config(
        cfg.parallel.__class__(dp_shard=shard, dp_replicate=8 // shard, ep=ep), cfg.model, 8, 4
    )
    return step_time(cfg, dims, fake_cluster(**cluster))


def test_the_busiest_ranks_imbalance_slows_its_experts_and_its_exchange():
    """plan.expert_imbalance = 2: the busiest ep rank receives twice the mean rows, so its
    exchange moves (1 + 2) / 2 of the balanced bytes and its experts' matmuls run twice the
    rows; without ep every expert is local and nothing changes."""
    even, busy = _time([], ep=4), _time(["plan.expert_imbalance=2.0"], ep=4)
    rows = even["comm"]["all_to_all/ep"]["bytes"]
    assert busy["comm"]["all_to_all/ep"]["bytes"] == pytest.approx(1.5 * rows, rel=1e-3)
    parts, busy_parts = even["compute_parts_s"], busy["compute_parts_s"]
    assert busy_parts["expert_matmul"] > 1.5 * parts["expert_matmul"]
    assert busy_parts["matmul"] == pytest.approx(parts["matmul"])
    local = _time(["plan.expert_imbalance=2.0"], ep=1)
    assert local["step_time_s"] == pytest.approx(_time([], ep=1)["step_time_s"])


def test_the_experts_fsdp_gathers_hide_behind_compute_as_the_blocks_do():
    """FSDP 8 with ep 2: the experts' own FSDP group (efsdp, 4 ranks) gathers and reduces
    beside the blocks' group; with full overlap and slow compute only the first unit's gather
    of each pass is exposed, so its exposed time is a small part of what it sends, while the
    token exchange in one piece (``parallel.ep_chunks=1``) is exposed whole, and in the default
    two chunks (``exchange_time``) only its first dispatch and last combine: half of it."""
    result = _time(["parallel.ep_chunks=1"], ep=2, peak_tflops=0.5)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=8, cp=1, tp=1, world_size=8, ranks_per_node=4, ep=2, moe=True
    )
    assert fsdp_groups(dims) == ["dp_shard", "efsdp"]
    links = result["comm_links"]
    gathered = links["all_gather/efsdp"]["seconds"] + links["reduce_scatter/efsdp"]["seconds"]
    assert 0 < result["exposed_comm_s"]["efsdp"] < 0.5 * gathered
    # The exchange over ep: exposed whole.
    on_ep = sum(link["seconds"] for key, link in links.items() if key.endswith("/ep"))
    assert result["exposed_comm_s"]["ep"] == pytest.approx(on_ep, rel=1e-9)
    assert links["all_to_all/ep"]["seconds"] > 0.5 * on_ep
    chunked = _time([], ep=2, peak_tflops=0.5)
    exchange = chunked["comm_links"]["all_to_all/ep"]["seconds"]
    assert chunked["exposed_comm_s"]["ep"] == pytest.approx(exchange / 2, rel=1e-9)


BREADTH, PER_CHUNK = ExchangeOrder.breadth_first, ExchangeOrder.per_chunk


@pytest.mark.parametrize(
    "links, compute, chunks, want, order",
    [
        (
            [4.0],
            6.0,
            1,
            10.0,
            BREADTH,
        ),  # one piece: the dispatch, the experts, the combine, in a row
        (
            [4.0],
            6.0,
            2,
            8.0,
            BREADTH,
        ),  # compute-bound: the first dispatch and the last combine exposed
        ([4.0], 6.0, 4, 7.0, BREADTH),
        ([8.0], 2.0, 2, 8.0, BREADTH),  # link-bound: the exchange whole, the experts behind it
        (
            [2.0],
            2.0,
            2,
            3.0,
            BREADTH,
        ),  # even: the first dispatch, two chunks' experts, the last combine
        # By node, NICs then NVLink (1 s a chunk each way on ep_inter, 0.5 on ep_intra):
        ([4.0, 2.0], 0.0, 1, 6.0, BREADTH),  # one piece: every stage in a row
        # 2 chunks, no compute: out over the NICs 0-1, 1-2; over NVLink 1-1.5 (chunk 1's NIC
        # stage beside it), 2-2.5 (the relay's work on chunk 1, issued before chunk 0's
        # experts, waits for its rows); back over NVLink 2.5-3, 3-3.5, the NICs 3-4, 4-5.
        ([4.0, 2.0], 0.0, 2, 5.0, BREADTH),
        # with 4 s of experts: chunk 0's at 2-4, chunk 1's at 4-6; back over NVLink 4-4.5,
        # 6-6.5; the relays' sums are issued after chunk 1's experts: the NICs 6-7, 7-8.
        ([4.0, 2.0], 4.0, 2, 8.0, BREADTH),
        # Per chunk (``parallel.ep_order=per_chunk``): chunk 1's relay after chunk 0's
        # experts, chunk 0's sums out right after its outputs return. No compute: out over
        # the NICs 0-1, 1-2, NVLink 1-1.5; chunk 0 back over NVLink 1.5-2, chunk 1 out 2-2.5;
        # chunk 0's sums over the NICs 2-3 beside chunk 1 back over NVLink 2.5-3; its sums 3-4.
        ([4.0, 2.0], 0.0, 2, 4.0, PER_CHUNK),
        # With 4 s of experts: chunk 0's at 1.5-3.5, its outputs back 3.5-4, chunk 1's rows
        # over NVLink only then, 4-4.5 (queued behind them), its experts 4.5-6.5, back
        # 6.5-7, its sums 7-8: no gain here.
        ([4.0, 2.0], 4.0, 2, 8.0, PER_CHUNK),
        # A faster NVLink stage (0.25 s a chunk), 2 s of experts: breadth first holds chunk
        # 0's experts until chunk 1's NIC stage has landed (2-3), per chunk runs them at
        # 1.25-2.25 and chunk 0's sums cross at 2.5-3.5, chunk 1's at 4-5.
        ([4.0, 1.0], 2.0, 2, 6.0, BREADTH),
        ([4.0, 1.0], 2.0, 2, 5.0, PER_CHUNK),
        # NVLink as slow as the NICs: per chunk queues chunk 1's relay behind chunk 0's
        # outputs on NVLink, breadth first does not.
        ([4.0, 4.0], 2.0, 2, 6.0, BREADTH),
        ([4.0, 4.0], 2.0, 2, 8.0, PER_CHUNK),
        # The flat exchange: the two orders are one.
        ([4.0], 6.0, 2, 8.0, PER_CHUNK),
    ],
)
def test_the_chunked_exchange_hides_behind_the_experts_as_its_schedule_runs(
    links, compute, chunks, want, order
):
    """``exchange_time``: the chunks through the stages in ``order`` (breadth first: each
    stage on every chunk before the next), each link a queue of its own, the compute in the
    order the host issued it; worked by hand. A step's exposed seconds are those timelines
    less the experts' compute, per pass."""
    from hsdp_runner.planner.exchange_time import exposed_exchange, timeline

    node = len(links) == 2  # the exchange by node: ep_inter, then ep_intra
    assert timeline(links, compute, chunks, node, order) == pytest.approx(want)
    twice = [2 * s for s in links]

    def exposed(e):
        return timeline(links, e, chunks, node, order) - e

    def step(links, experts, recompute, full, overlap=1.0):
        return exposed_exchange(
            links, experts, chunks, recompute, full, overlap, by_node=node, order=order
        )

    # No AC: a forward (1 part of the experts) and a backward (2 parts), equal exchanges.
    assert step(twice, 6.0, 0.0, False) == pytest.approx(exposed(2.0) + exposed(4.0))
    # Full AC: the exchange runs in the recomputed forward too, with its own experts' part.
    full = 2 * exposed(2.0) + exposed(4.0)
    assert step([3 * s for s in links], 8.0, 1.0, True) == pytest.approx(full)
    # cluster.overlap: the exchange hides behind that share of the experts' compute only (at
    # 0, none: on one link all of it is exposed; on two, chunks still pass each other).
    nothing = step(twice, 6.0, 0.0, False, 0.0)
    assert nothing == pytest.approx(2 * timeline(links, 0.0, chunks, node, order))
    assert nothing == pytest.approx(sum(twice)) or node
    assert step(twice, 6.0, 0.0, False, 0.5) == pytest.approx(exposed(1.0) + exposed(2.0))


def test_a_model_whose_experts_run_in_a_loop_is_priced_as_the_grouped_one():
    """``model.grouped_mm=false`` (the per-expert loop) splits rows by host values the traced
    meta model does not have; its work between matmuls is the grouped path's."""
    from hsdp_runner.planner.traffic import traffic

    def traced(grouped: str):
        cfg = to_run_config(plan.compose(["model=moe_tiny", f"model.grouped_mm={grouped}"]))
        return traffic(cfg.model, cfg.precision, False)

    assert traced("false") == traced("true")


@pytest.mark.parametrize("experts, top_k, nodes", [(8, 2, 2), (8, 3, 4), (16, 4, 4), (12, 5, 3)])
def test_expected_nodes_is_the_mean_over_every_choice_of_experts(experts, top_k, nodes):
    """``moe_comm.expected_nodes`` (derived: nodes x (1 - C(E - E/n, k) / C(E, k))) against
    the count of distinct nodes over every set of ``top_k`` experts, equally likely."""
    from itertools import combinations

    sets = list(combinations(range(experts), top_k))
    mean = sum(len({e // (experts // nodes) for e in s}) for s in sets) / len(sets)
    assert expected_nodes(experts, top_k, nodes) == pytest.approx(mean, rel=1e-12)


def test_an_ep_group_across_nodes_is_priced_by_node():
    """8 ranks on 2 nodes of 4 (fake_cluster), FSDP 8 with ep 8: the exchange runs by node,
    ep_inter (one rank a node: half its bytes leave through the rank's own NIC share) and
    ep_intra (a node's 4 ranks, NVLink). A token's 2 of 16 experts sit on 2 (1 - C(8, 2) /
    C(16, 2)) = 1.53 nodes on average, so the rows crossing the NICs are 1.53 / 2 of the flat
    exchange's (its 2 copies a token, half of them off the node), the copies' slots and
    weights (12 bytes a copy against a 1,024-byte row) aside."""
    cfg = to_run_config(plan.compose(MOE))
    parallel = cfg.parallel.__class__(dp_shard=8, dp_replicate=1, ep=8)
    dims = ParallelDims.from_config(parallel, cfg.model, 8, 4)
    assert dims.ep_nodes == 2
    assert placement_of(dims, "ep_inter") == Placement(2, 1, 4, 2)
    assert placement_of(dims, "ep_intra") == Placement(4, 4, 1, 1)
    cluster = fake_cluster()
    result = step_time(cfg, dims, cluster)
    comm, links = result["comm"], result["comm_links"]
    exchanged = {key for key in comm if key.startswith("all_to_all/")}
    assert exchanged == {"all_to_all/ep_inter", "all_to_all/ep_intra"}
    assert (links["all_to_all/ep_inter"]["link"], links["all_to_all/ep_intra"]["link"]) == (
        "nic",
        "nvlink",
    )
    # A rank's 4 sequences of 256 tokens, 2 MoE blocks, rows of 512 bf16; forward and
    # backward move each row twice, the copies' slots and weights once, and the counts of
    # each of the exchange's 2 chunks once.
    tokens, row, layers = 4 * 256, 512 * 2, 2
    pairs, copies = round(tokens * expected_nodes(16, 2, 2)), tokens * 2
    inter = comm["all_to_all/ep_inter"]
    assert inter["bytes"] == layers * (4 * pairs * row + copies * (8 + 4 + 4) + 2 * (16 + 2) * 8)
    nic = cluster.price(
        "all_to_all", placement_of(dims, "ep_inter"), inter["calls"], inter["bytes"]
    )
    flat_nic = layers * 4 * copies * row / 2 / (10 * GB)
    assert nic.link_s["nic"] / flat_nic == pytest.approx(expected_nodes(16, 2, 2) / 2, rel=0.01)
    assert result["exposed_comm_s"]["ep_inter"] > result["exposed_comm_s"]["ep_intra"] > 0
    # parallel.ep_order=null: the faster of the two orders, named for the plan row; each set
    # order is timed as set (here the NICs dominate: per chunk hides more of them).
    timed = {
        order: step_time(
            to_run_config(plan.compose([*MOE, f"parallel.ep_order={order}"])), dims, cluster
        )
        for order in ExchangeOrder
    }
    assert {order: t["ep_order"] for order, t in timed.items()} == {o: o.value for o in timed}
    per_chunk, breadth = (timed[o]["step_time_s"] for o in (PER_CHUNK, BREADTH))
    assert per_chunk < breadth and result["ep_order"] == "per_chunk"
    assert result["step_time_s"] == pytest.approx(per_chunk, rel=1e-12)


def test_a_plan_row_names_the_exchange_order_it_timed():
    """A layout whose ep group spans nodes is timed in the faster order where
    ``parallel.ep_order`` is null, and its row's overrides name it, so that parallel=auto and
    the row's command run what was timed; an ep group inside a node (the orders are one) names
    none."""
    from hsdp_runner.planner.layouts import plan_layouts

    tiny = ["model=moe_tiny", "model.n_experts=16"]
    fixed = {"dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1}
    rows = plan_layouts(plan.compose([*tiny, "plan.ep_degrees=[4,8]"]), fake_cluster(), {}, fixed)
    rows = {row["overrides"]["parallel.ep"]: row for row in rows}
    assert rows[4]["valid"] and "parallel.ep_order" not in rows[4]["overrides"]
    timed = {}
    for order in ExchangeOrder:
        cfg = to_run_config(plan.compose([*tiny, f"parallel.ep_order={order}"]))
        dims = ParallelDims.from_config(cfg.parallel.__class__(dp_shard=8, ep=8), cfg.model, 8, 4)
        timed[order.value] = step_time(cfg, dims, fake_cluster())["step_time_s"]
    faster = min(timed, key=timed.get)
    assert rows[8]["overrides"]["parallel.ep_order"] == faster
    assert rows[8]["step_time_s"] == pytest.approx(timed[faster], rel=1e-12)


def test_a_chunked_exchange_adds_each_chunks_kernels_and_its_gradient_sums():
    """moe_tiny in 2 chunks (``traffic``'s trace of the layer as a job runs it): more launches
    per block (each chunk's routing, grouped matmuls and weighted sum), about the same bytes
    per token (backward joins the chunks' input gradients: one more pass over them); the sums of each expert weight's gradients over the chunks are priced per local
    expert (``expert_grad_sum_bytes``: 1 sum of 8 / ep experts' three weights, two reads and
    a write, bf16), not at the trace's every expert. A dense model and ep 1 are unchanged."""
    from hsdp_runner.planner.precision_cost import expert_grad_sum_bytes
    from hsdp_runner.planner.traffic import traffic

    cfg = to_run_config(plan.compose(MOE))
    one, two = (traffic(cfg.model, cfg.precision, False, "cuda", c) for c in (1, 2))
    assert two.launches["block_forward"] > one.launches["block_forward"]
    assert two.launches["block_backward"] > one.launches["block_backward"]
    assert two.block_forward[0] == pytest.approx(one.block_forward[0], rel=0.05)
    assert one.block_backward[0] < two.block_backward[0] < 1.1 * one.block_backward[0]
    assert two.block_backward[1] < 2 * one.block_backward[1]  # no every-expert gradient sums
    m = cfg.model
    weights = 3 * m.n_experts * m.expert_ffn_dim * m.dim * (m.n_layers - m.n_dense_layers)
    for ep, chunks in ((2, "null"), (4, "3")):
        run = to_run_config(plan.compose([*MOE, f"parallel.ep_chunks={chunks}"]))
        parallel = run.parallel.__class__(dp_shard=8, ep=ep, ep_chunks=run.parallel.ep_chunks)
        dims = ParallelDims.from_config(parallel, run.model, 8)
        sums = {"null": 1, "3": 2}[chunks]
        assert expert_grad_sum_bytes(run, dims) == 3 * sums * weights / ep * 2
    dims = ParallelDims.from_config(cfg.parallel.__class__(dp_shard=8), cfg.model, 8)
    assert expert_grad_sum_bytes(cfg, dims) == 0.0
