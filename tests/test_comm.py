"""Communication accounting: what one step measurably sends equals the analytic model (+-1%).

One 4-rank and one 8-rank gloo run train one step of the tiny model in each layout, counting collectives with
``comm_counting.CommCounter``, and returns measured and analytic figures per (kind, mesh dim).
"""

import pytest
from distributed import run_workers
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
    "hsdp_tp": [
        "parallel=hsdp_tp",
        "precision=bf16",
        "trainer.grad_accum_steps=2",
        "trainer.accum_reduce=last",
    ],
    # Float8 all-gather: the float8 linears' weights gathered at one byte per element, the
    # scales' amax all-reduce after the optimizer step (distributed/float8.py).
    "hsdp_float8": ["parallel=hsdp", "precision=float8"],
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
    # GPT-2 (biases, LayerNorms with biases, a position table split by sequence parallel).
    "gpt2_hsdp_tp": ["model=gpt2_tiny", "parallel=hsdp_tp", "precision=bf16"],
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
EIGHT_RANKS = ("hsdp_tp", "gpt2_hsdp_tp", "fsdp_cp_tp")


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
    from rank_job import rank_trainer

    out = {}
    for name, cfg in configs.items():
        trainer, _ = rank_trainer(cfg)
        trainer.fit()
        out[name] = trainer.comm_facts
    return out


@pytest.fixture(scope="module")
def facts():
    """{layout: {rank: its communication facts}}: one set of four workers, one of eight."""
    out = {}
    for world, names in (
        (4, [n for n in LAYOUTS if n not in EIGHT_RANKS]),
        (8, list(EIGHT_RANKS)),
    ):
        ranks = run_workers(_measure_layouts, world, _layout_configs(names))
        for name in names:
            out[name] = {rank: per_layout[name] for rank, per_layout in ranks.items()}
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_measured_comm_bytes_match_the_analytic_model(facts, layout):
    for rank, f in facts[layout].items():
        assert f["comm_ratio"] == pytest.approx(1.0, abs=0.01), (rank, f)
        assert f["comm_bytes_measured"] >= f["comm_bytes_analytic"], (rank, f)
        # Every (kind, mesh dim) carrying 1% of the bytes or more: the same bytes and calls,
        # up to the few scalar reductions of clip_grad_norm_ (see comm_model) landing there.
        for key in set(f["comm_measured"]) - set(f["comm_analytic"]):
            assert f["comm_measured"][key]["bytes"] < 0.001 * f["comm_bytes_analytic"], (key, f)
        bulk = {
            key: entry
            for key, entry in f["comm_analytic"].items()
            if entry["bytes"] >= 0.01 * f["comm_bytes_analytic"]
        }
        assert bulk, f
        for key, expected in bulk.items():
            got = f["comm_measured"][key]
            assert got["bytes"] == pytest.approx(expected["bytes"], rel=1e-3), (rank, key, f)
            assert expected["calls"] <= got["calls"] <= expected["calls"] + 2, (rank, key, f)


def test_analytic_fsdp_bytes_match_a_hand_count():
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.step_stats import STATS_BYTES

    # llama3_tiny: a block holds wq 64x64, wk and wv 32x64, wo 64x64, w1/w3 192x64, w2 64x192
    # and two norms of 64 = 49,280 parameters; the root 2 x 256x64 + 64 = 32,832.
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


def test_analytic_cp_bytes_match_a_hand_count():
    """fsdp_cp with full AC: keys and values of llama3_tiny are 2 KV heads x 16 = 32 wide; a
    dp rank reads 8 / 2 = 4 sequences of 32 tokens; fp32. Per block, forward gathers
    2 x 4 x 32 x 32 x 4 bytes = 32,768 over cp, full AC gathers them again, and backward
    reduce-scatters their gradients once; FSDP's collectives run over dp_shard x cp."""
    from hsdp_runner.distributed.comm_model import analytic_comm
    from hsdp_runner.distributed.parallel_dims import ParallelDims

    cfg = compose(BASE + ["parallel=fsdp_cp", "parallel.ac=full"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4)
    got = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    assert got["all_gather/cp"] == {"calls": 4, "bytes": 4 * 32_768}
    assert got["reduce_scatter/cp"] == {"calls": 2, "bytes": 2 * 32_768}
    assert {"all_gather/dp_shard_cp", "reduce_scatter/dp_shard_cp"} <= set(got)


def test_analytic_accumulation_reduce_scatters_every_micro_batch_and_all_reduces_once():
    """llama3_tiny (131,392 parameters in 3 units, see above), fp32, 2 micro-batches. HSDP
    2 x 2: with ``every`` the whole gradients are reduce-scattered in each micro-batch, with
    ``last`` once; the replicate all-reduce of the half-size shard runs once either way. DDP
    (4 replicas) all-reduces the whole gradients once either way."""
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
            else:
                assert "reduce_scatter/dp_shard" not in got
