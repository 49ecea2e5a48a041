"""Communication accounting: what one step measurably sends equals the analytic model, exactly.

One 4-rank and one 8-rank gloo run train one step of the tiny model in each layout, counting
collectives with ``comm_counting.CommCounter``, and return measured and analytic figures per
(kind, mesh dim): the same calls and bytes in every one, on every rank. The mixture-of-experts
layouts (``moe_*``) ride in the same runs: their token exchange's bytes come from the counted
step's routing, which is uneven, so a balanced estimate would miss them.
"""

import itertools

import pytest
from distributed import own_groups, run_workers
from test_config import compose

BASE = [
    "model=llama3_tiny",
    "trainer.steps=1",
    "metrics.peak_tflops=1",
    "logger=none",
    "trainer.global_batch_size=8",
]
# name -> overrides. Three layouts need eight ranks (three dims of 2; cp x tp beside FSDP); the
# rest run on four (every dim they use at degree 2 or 4), which halves what their step costs
# (tp=4 needs 4 kv heads). Gradient accumulation rides along (a micro-batch more costs little):
# with trainer.accum_reduce=every a reduce-scatter per micro-batch (TP's partial norm gradients
# reduced with each) and HSDP's replicate all-reduce once; with last both once; DDP once.
LAYOUTS = {
    "fsdp": ["parallel=fsdp", "parallel.dp_shard=4"],
    "tp": ["parallel=tp", "parallel.tp=4", "model.n_kv_heads=4"],
    "hsdp": [
        "parallel=hsdp",
        "parallel.dp_shard=2",
        "precision=bf16",
        "trainer.global_batch_size=16",
        "trainer.grad_accum_steps=2",
        "trainer.accum_reduce=every",
    ],
    "fsdp_tp": [
        "parallel=fsdp_tp",
        "precision=bf16_pure",
        "trainer.grad_accum_steps=2",
        "trainer.accum_reduce=every",
    ],
    # ... its gathered block inputs saved as the rank's shards and gathered again in backward
    # (parallel.sp_save_shard), each micro-batch.
    "hsdp_tp": [
        "parallel=hsdp_tp",
        "precision=bf16",
        "trainer.grad_accum_steps=2",
        "trainer.accum_reduce=last",
        "parallel.sp_save_shard=true",
    ],
    # Float8 all-gather: the float8 linears' weights gathered at one byte per element, the
    # scales' amax all-reduce after the optimizer step (distributed/float8.py). The default
    # metrics.comm_step=1 counts step 2 here: step 1 has no precomputed scales, so torchao
    # all-reduces each weight's amax at each gather instead (comm_model).
    "hsdp_float8": [
        "parallel=hsdp",
        "precision=float8",
        "trainer.steps=2",
        "metrics.comm_step=1",
    ],
    # TP without a data-parallel wrapper (fp32, no dp): the norms' partial gradients stay
    # partial and are all-reduced by the clip's norm and again by AdamW; the frozen output
    # layer and attention of block 1 have no gradient to clip.
    "tp_frozen": [
        "parallel=tp",
        "parallel.tp=4",
        "model.n_kv_heads=4",
        "trainer.freeze=[output.*,layers.1.attention.*]",
    ],
    "ddp_tp_no_sp": [
        "parallel=hsdp_tp",
        "parallel.dp_replicate=2",
        "parallel.dp_shard=1",
        "parallel.sequence_parallel=false",
        "trainer.grad_accum_steps=2",
    ],
    # Activation checkpointing with TP: selective repeats no collective, full repeats the
    # blocks' forward ones in backward (with or without sequence parallel: the same rule).
    "fsdp_tp_selective_ac": ["parallel=fsdp_tp", "parallel.ac=selective"],
    "fsdp_tp_full_ac": ["parallel=fsdp_tp", "parallel.ac=full"],
    # GPT-2 (biases, LayerNorms with biases, a position table split by sequence parallel),
    # its attention and MLP inputs saved as shards; on four ranks (its replicate all-reduce is
    # gpt2_ddp_tp_no_sp's below).
    "gpt2_fsdp_tp": [
        "model=gpt2_tiny",
        "parallel=fsdp_tp",
        "precision=bf16",
        "parallel.sp_save_shard=true",
    ],
    # ... and its logits all-gathered for the loss (the other TP layouts run the loss on
    # vocabulary-sharded logits: three all-reduces of a float per token).
    "gpt2_ddp_tp_no_sp": [
        "model=gpt2_tiny",
        "parallel=hsdp_tp",
        "parallel.dp_replicate=2",
        "parallel.dp_shard=1",
        "parallel.sequence_parallel=false",
        "parallel.loss_parallel=false",
    ],
    # Context parallel: the K/V all-gather per block and its gradients' reduce-scatter (again
    # under full AC; selective saves it); FSDP shards over dp_shard x cp.
    "fsdp_cp_tp": [
        "parallel=fsdp_cp",
        "parallel.tp=2",
        "precision=bf16",
        "trainer.grad_accum_steps=2",
    ],
    "hsdp_cp_full_ac": [
        "parallel=hsdp_cp_tp",
        "parallel.cp=2",
        "parallel.tp=1",
        "parallel.ac=full",
    ],
    "gpt2_cp_selective_ac": [
        "model=gpt2_tiny",
        "parallel=cp",
        "parallel.cp=4",
        "parallel.ac=selective",
    ],
}
# A mixture of experts (moe_tiny: a dense block, then two MoE blocks of 8 experts, top 2, a
# shared expert, QK-norm, the auxiliary loss), one layout per way expert parallel borrows its
# ranks, with the MoE layers' own FSDP units, the token exchange and its recomputation.
MOE = ["model=moe_tiny"]
LAYOUTS |= {
    # ep splits dp_shard 4: new efsdp and ep groups. Two experts, top 1: a rank holds one, fewer
    # than efsdp's 2 ranks, so FSDP shards the experts' weights on dim 1, not the experts'
    # dim 0 (which it would pad to two: param_sizes.expert_shard_dim).
    "moe_fsdp_ep2": [*MOE, "model.n_experts=2", "model.top_k=1", "parallel=fsdp", "parallel.ep=2"],
    # HSDP, ep = dp_shard 2: the experts' shards all-reduced over dp_replicate; bf16 and two
    # micro-batches, each reduce-scattering and exchanging its own tokens.
    "moe_hsdp_ep2_accum": [
        *MOE,
        "parallel=hsdp",
        "parallel.ep=2",
        "precision=bf16",
        "trainer.global_batch_size=16",
        "trainer.grad_accum_steps=2",
        "trainer.accum_reduce=every",
    ],
    # ep = tp: an MoE block has attention's TP collectives alone; full AC recomputes the
    # exchange and the auxiliary loss's count all-reduce.
    "moe_fsdp_tp_ep2_full_ac": [*MOE, "parallel=fsdp_tp", "parallel.ep=2", "parallel.ac=full"],
    # TP alone (no data-parallel wrap), ep splitting tp, no sequence parallel: the MoE's
    # output and input gradient all-gathered, the q/k norms' partial gradients; selective AC
    # saves the exchange.
    "moe_tp_ep2_no_sp_selective_ac": [
        *MOE,
        "parallel=tp",
        "parallel.tp=4",
        "model.n_kv_heads=4",
        "parallel.ep=2",
        "parallel.sequence_parallel=false",
        "parallel.ac=selective",
    ],
    # ep = cp: the exchange over the cp group, the auxiliary loss's counts summed over it;
    # the MoE feed-forward recomputed alone (parallel.ac=moe): its exchange and count
    # all-reduce run again, attention's K/V all-gather does not.
    "moe_fsdp_cp_ep2_accum_moe_ac": [
        *MOE,
        "parallel=fsdp_cp",
        "parallel.ep=2",
        "trainer.grad_accum_steps=2",
        "trainer.accum_reduce=last",
        "parallel.ac=moe",
    ],
    # TP alone without sequence parallel, the MoE feed-forward recomputed alone: its exchange
    # runs again; attention's all-reduces do not, nor the MoE's output all-gather (the
    # checkpoint's recompute stops once backward's saved tensors are rebuilt).
    "moe_tp_ep2_no_sp_moe_ac": [
        *MOE,
        "parallel=tp",
        "parallel.tp=4",
        "model.n_kv_heads=4",
        "parallel.ep=2",
        "parallel.sequence_parallel=false",
        "parallel.ac=moe",
    ],
    # pp 2 x tp 2, ep = tp: every micro-batch of the schedule exchanges its tokens; the MoE
    # layers' own units, without a wrap around them, gather and reduce in each micro-batch.
    # Step 2 is counted (step 1 runs the schedule's shape inference).
    "moe_pp_tp_ep2": [*MOE, "parallel=pp", "parallel.tp=2", "parallel.ep=2", "trainer.steps=2"],
    # HSDP x cp x TP on 8 ranks, ep = cp x tp over dp_shard_cp_tp.
    "moe_hsdp_cp_tp_ep4": [*MOE, "parallel=hsdp_cp_tp", "parallel.ep=4"],
    # ep 4 over two "nodes" of 2 ranks (RANKS_PER_NODE): the token exchange by node, over
    # ep_inter (a rank of each node) and ep_intra (a node's ranks); full AC recomputes both.
    "moe_fsdp_ep4_2_nodes_full_ac": [*MOE, "parallel=fsdp", "parallel.ep=4", "parallel.ac=full"],
}
EIGHT_RANKS = ("hsdp_tp", "fsdp_cp_tp", "moe_hsdp_cp_tp_ep4")
# Layouts whose ranks are told they sit on nodes of this many (a launch's LOCAL_WORLD_SIZE).
RANKS_PER_NODE = {"moe_fsdp_ep4_2_nodes_full_ac": 2}


def _layout_configs(names):
    """{layout: its typed config} for ``names``: composed and converted once here, not on
    every rank."""
    from hsdp_runner.config.compose import to_run_config

    configs = {}
    for name in names:
        overrides = LAYOUTS[name]
        base = [
            o
            for o in BASE
            if not (o.startswith("model=") and any(m.startswith("model=") for m in overrides))
        ]
        configs[name] = to_run_config(compose(base + overrides))
    return configs


def _measure_layouts(configs):
    """{layout: the rank's comm facts, with the analytic figure of balanced experts
    (``comm_balanced``)}, then under 'c10d_all_to_all' what ``_c10d_all_to_all`` counts."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from hsdp_runner.runtime.rank_training import rank_trainer

    out = {}
    for name, cfg in configs.items():
        # A job has its process to itself. Here DTensor's sharding caches (Python's and the
        # C++ fast path's) would hand this layout the output specs of an earlier one whose
        # meshes compare equal (DeviceMesh equality ignores the root mesh), and with them that
        # world's meshes, and with them collectives over another world's groups.
        _clear_sharding_prop_cache()
        with own_groups():
            trainer, _ = rank_trainer(cfg, ranks_per_node=RANKS_PER_NODE.get(name))
            trainer.fit()
            out[name] = trainer.comm_facts | {"comm_balanced": trainer.figures.analytic_comm()}
            del trainer
    out["c10d_all_to_all"] = _c10d_all_to_all()
    return out


def _c10d_all_to_all() -> dict:
    """What ``CommCounter`` counts of c10d's all-to-alls over all ranks: ``all_to_all_single``
    of 3 fp32 rows of 2 per rank (24 bytes a rank), ``all_to_all`` of one int64 per rank."""
    import torch
    import torch.distributed as dist

    from hsdp_runner.distributed.comm_counting import CommCounter
    from hsdp_runner.distributed.parallel_dims import ParallelDims

    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=world, tp=1, world_size=world)
    counter = CommCounter(dims.build_mesh("cpu"))
    with counter:
        dist.all_to_all_single(torch.empty(3 * world, 2), torch.ones(3 * world, 2))
        dist.all_to_all(list(torch.empty(world, 1).long()), list(torch.ones(world, 1).long()))
    return counter.result()


@pytest.fixture(scope="module")
def facts():
    """{layout: {rank: its communication facts}}: one set of four workers, one of eight
    ('c10d_all_to_all': the four ranks' count of c10d's all-to-alls)."""
    out = {}
    for world, names in (
        (4, [n for n in LAYOUTS if n not in EIGHT_RANKS]),
        (8, list(EIGHT_RANKS)),
    ):
        ranks = run_workers(_measure_layouts, world, _layout_configs(names))
        for name in names + ["c10d_all_to_all"] * (world == 4):
            out[name] = {rank: per_layout[name] for rank, per_layout in ranks.items()}
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_measured_comm_bytes_match_the_analytic_model(facts, layout):
    for rank, f in facts[layout].items():
        assert round(f["comm_ratio"], 4) == 1.0, (rank, f)
        # Every (kind, mesh dim): the same calls and bytes, the step's stats too.
        assert f["comm_measured"] == f["comm_analytic"], (rank, f)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if "_ep" in name])
def test_token_exchange_bytes_follow_the_counted_steps_routing(facts, layout):
    """The experts receive uneven rows: some rank's all-to-all bytes differ from a balanced
    estimate, and the analytic figure (with the routing) still equals the measured one."""
    uneven = [
        rank
        for rank, f in facts[layout].items()
        if f["comm_balanced"] != f["comm_analytic"]
        and {k: v["calls"] for k, v in f["comm_balanced"].items()}
        == {k: v["calls"] for k, v in f["comm_measured"].items()}
    ]
    assert uneven, facts[layout]


@pytest.mark.multiprocess
def test_an_ep_group_across_nodes_exchanges_over_its_two_stages_alone(facts):
    """ep 4 over 2 nodes of 2: the token exchange's all-to-alls run over ep_inter and
    ep_intra, none over the whole ep group (here dp_shard)."""
    for rank, f in facts["moe_fsdp_ep4_2_nodes_full_ac"].items():
        kinds = {key for key in f["comm_measured"] if key.startswith("all_to_all/")}
        assert kinds == {"all_to_all/ep_inter", "all_to_all/ep_intra"}, (rank, kinds)


@pytest.mark.multiprocess
def test_c10d_all_to_alls_are_counted_by_their_input(facts):
    for rank, counted in facts["c10d_all_to_all"].items():
        assert counted == {"all_to_all/dp_shard": {"calls": 2, "bytes": 4 * 24 + 4 * 8}}, rank


def test_analytic_fsdp_bytes_match_a_hand_count():
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.step_stats import STATS_BYTES

    # llama3_tiny: a block holds wq 64x64, wk and wv 32x64, wo 64x64, w1/w3 192x64, w2 64x192
    # and two norms of 64 = 49,280 parameters; the root 2 x 256x64 + 64 = 32,832. The clip's
    # norm rides in the step's stats (dp_shard spans both ranks): no all-reduce of its own.
    blocks, root = 2 * 49_280, 32_832
    for reshard, gathers in ((True, 5), (False, 3)):
        cfg = compose(
            BASE
            + ["parallel=fsdp", "parallel.dp_shard=2", f"parallel.reshard_after_forward={reshard}"]
        )
        dims = ParallelDims.from_config(cfg.parallel, cfg.model, 2)
        got = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
        gathered = (blocks + root + (blocks if reshard else 0)) * 4  # fp32
        assert got == {
            "all_gather/dp_shard": {"calls": gathers, "bytes": gathered},
            "reduce_scatter/dp_shard": {"calls": 3, "bytes": (blocks + root) * 4},
            "all_reduce/dp_shard": {"calls": 1, "bytes": STATS_BYTES},
        }


def test_experts_fewer_than_their_fsdp_ranks_are_sharded_without_padding():
    """moe_tiny's two MoE blocks with 2 experts at ep 2 over FSDP 4: a rank holds one expert
    (w1, w3 of 32 x 64 and w2 of 64 x 32, fp32) and efsdp has 2 ranks. Sharded on the
    experts' dim, FSDP would pad it to two experts and gather and reduce both; on dim 1 it
    gathers the one (forward and backward, resharded after forward) and reduce-scatters it
    once. The comm pool's 'moe_fsdp_ep2' measures the same layout (measured = analytic)."""
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.param_sizes import expert_shard_dim

    assert expert_shard_dim((1, 32, 64), 2) == 1  # one expert over 2 ranks: dim 1
    assert expert_shard_dim((4, 32, 64), 2) == 0  # 4 experts over 2: no padding on dim 0
    assert expert_shard_dim((3, 32, 64), 2) == 1  # 3 experts pad to 4; 32 rows divide
    assert expert_shard_dim((3, 5, 64), 4) == 0  # 3 -> 4 pads less than 5 -> 8
    assert expert_shard_dim((2, 32, 64), 1) == 0
    cfg = compose([*BASE, *LAYOUTS["moe_fsdp_ep2"]])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4)
    got = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    expert = 3 * 32 * 64 * 4  # bytes of one expert's three weights, fp32
    assert got["all_gather/efsdp"] == {"calls": 4, "bytes": 4 * expert}
    assert got["reduce_scatter/efsdp"] == {"calls": 2, "bytes": 2 * expert}


def test_analytic_cp_bytes_match_a_hand_count():
    """fsdp_cp with full AC: keys and values of llama3_tiny are 2 KV heads x 16 = 32 wide; a
    dp rank reads 8 / 2 = 4 sequences of 32 tokens; fp32. Per block, forward gathers
    2 x 4 x 32 x 32 x 4 bytes = 32,768 over cp, full AC gathers them again, and backward
    reduce-scatters their gradients once; FSDP's collectives run over dp_shard x cp, and so
    does the step's stats (it spans all 4; the clip's norm rides in it)."""
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.step_stats import STATS_BYTES

    cfg = compose(BASE + ["parallel=fsdp_cp", "parallel.ac=full"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4)
    got = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    assert got["all_gather/cp"] == {"calls": 4, "bytes": 4 * 32_768}
    assert got["reduce_scatter/cp"] == {"calls": 2, "bytes": 2 * 32_768}
    assert {"all_gather/dp_shard_cp", "reduce_scatter/dp_shard_cp"} <= set(got)
    assert got["all_reduce/dp_shard_cp"] == {"calls": 1, "bytes": STATS_BYTES}


def test_analytic_accumulation_reduce_scatters_every_micro_batch_and_all_reduces_once():
    """llama3_tiny (131,392 parameters in 3 units, see above), fp32, 2 micro-batches. HSDP
    2 x 2: with ``every`` the whole gradients are reduce-scattered in each micro-batch, with
    ``last`` once; the replicate all-reduce of the half-size shard runs once either way. DDP
    (4 replicas) all-reduces the whole gradients once either way. The clip's norm rides in
    the step's stats, which span all ranks: under HSDP no group of the mesh does."""
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.step_stats import STATS_BYTES

    whole = 131_392 * 4
    for choice, reductions in (("every", 2), ("last", 1)):
        for layout, degrees in (("hsdp", [2, 2]), ("ddp", [4, 1])):
            cfg = compose(
                BASE
                + [
                    f"parallel={layout}",
                    f"parallel.dp_replicate={degrees[0]}",
                    f"parallel.dp_shard={degrees[1]}",
                    "trainer.grad_accum_steps=2",
                    f"trainer.accum_reduce={choice}",
                ]
            )
            dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4)
            got = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
            shard = whole // degrees[1]
            # Over 4 replicas dp_replicate spans every rank: the step's stats all-reduce too.
            stats = (
                {"calls": 1, "bytes": STATS_BYTES} if layout == "ddp" else {"calls": 0, "bytes": 0}
            )
            assert got["all_reduce/dp_replicate"] == {
                "calls": 3 + stats["calls"],
                "bytes": shard + stats["bytes"],
            }, layout
            if layout == "hsdp":
                assert got["reduce_scatter/dp_shard"] == {
                    "calls": 3 * reductions,
                    "bytes": whole * reductions,
                }, choice
                assert "all_reduce/dp_shard" not in got
            else:
                assert "reduce_scatter/dp_shard" not in got
                assert "all_reduce/dp_shard" not in got


def _tp_comm(*overrides, world=2):
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.distributed.parallel_dims import ParallelDims

    cfg = compose(BASE + list(overrides))
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world)
    return analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)


def test_analytic_tp_all_reduces_match_a_hand_count():
    """llama3_tiny (5 norms of 64: 2 a block and the final one; 21 gradients), 8 sequences of
    32 tokens. TP 2 alone in fp32 (no data-parallel wrapper): per sequence-parallel norm its
    partial gradient twice (the clip's norm, then AdamW: 2 x 64 x 4 bytes), the loss's 3 x 256
    fp32 and the step's stats (tp spans both ranks; the clip's norm rides in them).
    Freezing the output layer and block 1's attention (4 linears) leaves 16 gradients, the
    5 norms among them; freezing block 0 too leaves 7, 3 norms (the model's count: under
    sequence parallel torch 2.13's ``SequenceParallel`` re-creates the norms' parameters with
    ``requires_grad`` on, so the runner trains them anyway, see ``comm_model``)."""
    from hsdp_runner.distributed.step_stats import STATS_BYTES

    loss, stats = {"calls": 3, "bytes": 3 * 256 * 4}, {"calls": 1, "bytes": STATS_BYTES}
    for freeze, norms in (
        ("[]", 5),
        ("[output.*,layers.1.attention.*]", 5),
        ("[output.*,layers.1.attention.*,layers.0.*]", 3),
    ):
        got = _tp_comm("parallel=tp", "parallel.tp=2", f"trainer.freeze={freeze}")
        partial = {"calls": 2 * norms, "bytes": 2 * norms * 64 * 4}
        assert got["all_reduce/tp"] == {k: partial[k] + loss[k] + stats[k] for k in loss}, freeze


def test_analytic_partial_norm_gradients_take_the_dtype_fsdp_holds_them_in():
    """fsdp_tp 2 x 2 in bf16 (fp32 reduction), 2 micro-batches: with ``every`` FSDP reduces
    each micro-batch's bf16 gradients, the 5 norms' partial ones over tp too (2 x 5 x 64 x 2
    bytes); with ``last`` it accumulates the first micro-batch's in fp32 and reduces them once
    (5 x 64 x 4). The loss adds 2 x 3 x 64 fp32 (4 sequences of 32 tokens a rank, 2 passes);
    the clip's norm rides in the step's stats, over all 4 ranks."""
    loss = 3 * 128 * 4
    for choice, partial in (
        ("every", {"calls": 10, "bytes": 1280}),
        ("last", {"calls": 5, "bytes": 1280}),
    ):
        got = _tp_comm(
            "parallel=fsdp_tp",
            "precision=bf16",
            "trainer.grad_accum_steps=2",
            f"trainer.accum_reduce={choice}",
            world=4,
        )
        assert got["all_reduce/tp"] == {
            "calls": partial["calls"] + 6,
            "bytes": partial["bytes"] + loss,
        }, choice


@pytest.mark.parametrize("family", ["llama3_tiny", "gpt2_tiny", "moe_tiny"])
def test_partial_gradients_are_the_norms_the_model_spec_lists(family):
    """The parameters TP keeps whole (no parameter of their module split; a mixture of experts'
    MoE layers are no TP module) are the norms whose sizes ``ModelSpec.tp_partial_grad_numels``
    lists; without sequence parallel only the q/k norms' (moe_tiny's: 3 blocks x 2 of 16)."""
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.param_sizes import tp_partial_grads
    from hsdp_runner.models.base import model_spec

    cfg = compose([f"model={family}", "parallel=fsdp_tp"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4)
    assert tp_partial_grads(cfg.model, dims) == model_spec(cfg.model).tp_partial_grad_numels()
    without = [16] * 6 if family == "moe_tiny" else []
    assert tp_partial_grads(cfg.model, dims, sequence_parallel=False) == without


def test_analytic_token_exchange_matches_a_hand_count():
    """moe_tiny (2 MoE blocks of 8 experts, top 2, dim 64) under FSDP 4 with ep 2, fp32: a
    rank reads 2 sequences of 32 tokens and sends 128 routed rows per MoE block. Per block,
    forward all-to-alls the counts (8 int64), the 128 rows sent, their 128 router weights
    (fp32) and the rows received (combine), backward the received rows' gradients, the
    received weights' and the sent rows'; full AC repeats the forward's four. Here the rank
    receives 131 rows in block 1 and 125 in block 2; balanced, 128 each. In C chunks
    (``parallel.ep_chunks``; null: 2 here) the counts of all chunks go in one call (C x 8
    int64) and the rows and weights in C calls each: the same rows."""
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.distributed.parallel_dims import ParallelDims

    row, counts = 64 * 4, 8 * 8
    routing = [(128, 131), (128, 125)]
    for (ac, passes), (chunks, c) in itertools.product(
        (("none", 1), ("full", 2)), (("1", 1), ("null", 2), ("3", 3))
    ):
        overrides = [*MOE, "parallel=fsdp", "parallel.ep=2", f"parallel.ep_chunks={chunks}"]
        cfg = compose(BASE + [*overrides, f"parallel.ac={ac}"])
        dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4)
        args = (cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
        rows = sum(sent + received for sent, received in routing)
        weights = sum(passes * sent + received for sent, received in routing) * 4
        assert analytic_comm(*args, routing=routing)["all_to_all/ep"] == {
            "calls": 2 * ((1 + 3 * c) * passes + 3 * c),
            "bytes": 2 * passes * c * counts + (passes + 1) * rows * row + weights,
        }, (ac, chunks)
        balanced = analytic_comm(*args)["all_to_all/ep"]["bytes"]
        want = 2 * passes * c * counts + (passes + 1) * 4 * 128 * row + 2 * (passes + 1) * 128 * 4
        assert balanced == want, (ac, chunks)


def test_analytic_token_exchange_by_node_matches_a_hand_count():
    """moe_tiny (2 MoE blocks of 8 experts, top 2, dim 64, fp32) under FSDP 4 with ep 4 over
    2 nodes of 2. Per block and dispatch the rank sends D rows (its distinct (node, token)
    pairs) and N = 128 copies' slots (int64) and weights (fp32) over ep_inter and gets D'
    rows and C' copies; its node's relay forwards C' rows and their weights over ep_intra
    and its experts get M. Forward over ep_inter: the counts (8 + 2 int64), D rows, N slots,
    N weights, D' summed rows; backward D', C' weights' gradients, D. Over ep_intra: the
    counts (8 int64), C' rows, C' weights, M; backward M, M weights' gradients, C'. Full AC
    repeats each forward. In C chunks (null: 2) each stage's counts go
    in one call (C times the bytes), every other call once a chunk."""
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.distributed.moe_comm import expected_nodes
    from hsdp_runner.distributed.parallel_dims import ParallelDims

    row = 64 * 4
    routing = [(100, 97, 128, 131, 125), (90, 95, 128, 120, 133)]
    for (ac, passes), (chunks, c) in itertools.product(
        (("none", 1), ("full", 2)), (("1", 1), ("null", 2))
    ):
        overrides = [*MOE, "parallel=fsdp", "parallel.ep=4", f"parallel.ep_chunks={chunks}"]
        cfg = compose(BASE + [*overrides, f"parallel.ac={ac}"])
        dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4, 2)
        assert (dims.ep_nodes, dims.group_size("ep_inter"), dims.group_size("ep_intra")) == (
            2,
            2,
            2,
        )
        args = (cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
        comm = analytic_comm(*args, routing=routing)
        assert "all_to_all/dp_shard" not in comm and "all_to_all/ep" not in comm
        inter = sum(
            passes * (c * 10 * 8 + d * row + n * 8 + n * 4 + d_in * row)
            + (d_in + d) * row
            + c_in * 4
            for d, d_in, n, c_in, _ in routing
        )
        calls = 2 * ((1 + 4 * c) * passes + 3 * c)
        assert comm["all_to_all/ep_inter"] == {"calls": calls, "bytes": inter}, (ac, c)
        intra = sum(
            passes * (c * 8 * 8 + (c_in + m) * row + c_in * 4) + (m + c_in) * row + m * 4
            for *_, c_in, m in routing
        )
        calls = 2 * ((1 + 3 * c) * passes + 3 * c)
        assert comm["all_to_all/ep_intra"] == {"calls": calls, "bytes": intra}, (ac, c)
        # Balanced: 2 sequences of 32 tokens, each on 2 x (1 - C(4, 2) / C(8, 2)) nodes.
        pairs = round(64 * expected_nodes(8, 2, 2))
        assert pairs == round(64 * 2 * (1 - 6 / 28)) == 101
        balanced = analytic_comm(*args)["all_to_all/ep_intra"]["bytes"]
        assert balanced == 2 * (passes * c * 8 * 8 + (passes + 1) * (2 * 128 * row + 128 * 4)), ac
