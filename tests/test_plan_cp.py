"""The planner and context parallel: cp degrees enumerated, cp's key/value exchange priced on
the critical path, and a long-sequence 8B plan that only cp layouts fit."""

import json

import pytest
from clusters import fake_cluster

from hsdp_runner import plan
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.comm_model import (
    analytic_comm,
    attention_regather_comm,
    context_parallel_comm,
)
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.planner import layouts as layouts_mod
from hsdp_runner.planner.cluster import Cluster, resolve
from hsdp_runner.planner.degrees import auto_cp_degrees, cp_degrees, degree_shapes
from hsdp_runner.planner.step_time import comm_times, step_time

TINY = [
    "model=llama3_tiny",
    "model.n_layers=1",
    "trainer.global_batch_size=8",
    "cluster.gpus_per_node=4",
]


def _shapes(layouts: list[dict]) -> set[tuple]:
    """(dp_replicate, dp_shard, cp, tp) of each layout (a dense model's ep is always 1)."""
    return {e["shape"][:4] for e in layouts}


def test_automatic_cp_degrees_split_the_sequence_in_2cp_chunks_inside_a_node():
    assert auto_cp_degrees(32, 4, 4, False) == [1, 2, 4]
    assert auto_cp_degrees(12, 4, 4, False) == [1, 2]  # 12 tokens: no 8 equal chunks
    assert auto_cp_degrees(64, 8, 2, False) == [1, 2]  # cp 4 and 8 would cross nodes
    assert auto_cp_degrees(64, 8, 2, True) == [1, 2, 4, 8]
    assert cp_degrees([4, 1, 4], 32, 8, 8, False) == [1, 4]
    with pytest.raises(ConfigError, match="plan.cp_degrees=\\[3\\]"):
        cp_degrees([3], 32, 4, 4, False)


def test_degree_shapes_are_every_factorisation_of_the_world_with_the_cp_degrees_asked():
    shapes = degree_shapes(8, [1, 2, 4, 8])
    assert len(shapes) == len(set(shapes)) == 20  # ordered 4-factor products of 2^3
    assert all(r * s * c * t == 8 and ep == 1 for r, s, c, t, ep in shapes)  # dense: ep 1
    assert degree_shapes(8, [1]) == [(r, s, 1, t, 1) for r, s, _, t, _ep in shapes if _ == 1]


def test_expert_degrees_are_the_powers_of_two_dividing_the_borrowed_ranks_and_the_experts():
    from hsdp_runner.planner.degrees import check_ep_degrees, ep_degrees

    # 8 ranks, 4 experts: ep over powers of two dividing both dp_shard x cp x tp and 4.
    shapes = degree_shapes(8, [1], None, experts=4)
    assert (1, 8, 1, 1, 4) in shapes and (1, 8, 1, 1, 8) not in shapes
    assert [s for s in shapes if s[:4] == (2, 2, 1, 2)] == [(2, 2, 1, 2, ep) for ep in (1, 2, 4)]
    assert [s[4] for s in shapes if s[:4] == (8, 1, 1, 1)] == [1]  # DDP borrows no rank
    assert ep_degrees(None, 12, 12) == [1, 2, 4]  # 3 and 6 divide both, but are no power of 2
    assert ep_degrees([2, 8], 8, 4) == [2]  # asked, those the layout's ranks allow
    assert ep_degrees(None, 0, 8) == [1]  # a dense model
    with pytest.raises(ConfigError, match=r"plan.ep_degrees=\[2\]: the model has no routed"):
        check_ep_degrees([2], 0)
    with pytest.raises(ConfigError, match=r"plan.ep_degrees=\[0\]: each expert-parallel"):
        check_ep_degrees([0], 8)


def test_enumeration_includes_cp_layouts_and_cp_degrees_1_keeps_the_old_list():
    cfg = to_run_config(plan.compose(TINY))
    layouts = layouts_mod.enumerate_layouts(cfg, 4, 4)
    assert len(layouts) == 10
    assert {(1, 2, 2, 1), (2, 1, 2, 1), (1, 1, 4, 1), (1, 1, 2, 2)} <= _shapes(layouts)
    cp_layouts = [e for e in layouts if e["shape"][2] > 1]
    assert all(e["dims"] and e["dims"].cp == e["shape"][2] for e in cp_layouts)
    assert {e["dims"].layout for e in cp_layouts} == {"fsdp_cp", "hsdp_cp", "fsdp_cp_tp"}
    old_cfg = to_run_config(plan.compose(TINY + ["plan.cp_degrees=[1]"]))
    old = layouts_mod.enumerate_layouts(old_cfg, 4, 4)
    assert _shapes(old) == {s for s in _shapes(layouts) if s[2] == 1} and len(old) == 6


def _cluster(**kw) -> Cluster:
    return fake_cluster(**{"gpus_per_node": 8, "nodes": 1, "nics_per_node": 8, **kw})


LONG = ["model=llama3_8b", "precision=bf16", "model.seq_len=32768", "trainer.global_batch_size=1"]


@pytest.mark.parametrize("ac, gathers", [("none", 1), ("selective", 1), ("full", 2)])
def test_cp_moves_the_whole_sequences_keys_and_values_per_block(ac, gathers):
    cfg = plan.compose(LONG + [f"parallel.ac={ac}"])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=4, tp=2, world_size=8)
    kv = context_parallel_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    # keys + values of 32768 tokens x (8 kv heads / tp 2) x head_dim 128 in bf16, per block
    per_block = 2 * 32768 * 4 * 128 * 2
    assert kv == {
        "all_gather/cp": {"calls": 32 * gathers, "bytes": 32 * gathers * per_block},
        "reduce_scatter/cp": {"calls": 32, "bytes": 32 * per_block},
    }
    no_cp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=8, world_size=8)
    assert context_parallel_comm(cfg.model, no_cp, cfg.parallel, cfg.precision, cfg.trainer) == {}


def test_cp_exchange_is_exposed_while_fsdp_over_the_same_group_hides_behind_compute():
    """cp = 8 alone: FSDP shards over the cp ranks, so its collectives share the 'cp' keys with
    the key/value exchange; only the exchange (and FSDP's first and last units) is exposed."""
    cfg = plan.compose(LONG)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=8, tp=1, world_size=8)
    comm = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    kv = context_parallel_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    assert comm["all_gather/cp"]["bytes"] > kv["all_gather/cp"]["bytes"]  # FSDP's in there too
    assert "all_gather/dp_shard" not in comm
    cluster = _cluster()
    kv_s = sum(comm_times(kv, dims, cluster).values())
    time = step_time(cfg, dims, cluster)
    assert set(time["exposed_comm_s"]) == {"cp"}
    assert time["exposed_comm_s"]["cp"] > kv_s
    assert time["comm_total_s"] == pytest.approx(sum(comm_times(comm, dims, cluster).values()))
    # The same FSDP collectives over dp_shard hide the same way: only the exchange differs.
    fsdp = step_time(
        cfg, ParallelDims(dp_replicate=1, dp_shard=8, cp=1, tp=1, world_size=8), cluster
    )
    assert time["exposed_comm_s"]["cp"] - fsdp["exposed_comm_s"]["dp_shard"] == pytest.approx(
        kv_s, rel=0.05
    )


LONG_8B = [
    "model=llama3_8b",
    "model.seq_len=65536",
    "precision=bf16",
    "trainer.global_batch_size=1",
    "parallel.ac=full",
]


def test_long_sequence_8b_plan_ranks_cp_first_when_memory_forces_it(tmp_path, monkeypatch, capsys):
    """Llama 3 8B, one 64k-token sequence per step on 8 H100s: with one sequence no rank can
    take a batch row of its own, so either TP or cp splits the sequence. With the logits
    all-gathered for the loss (``parallel.loss_parallel=false``) TP leaves every rank the whole
    vocabulary's fp32 loss temporaries for the whole sequence and does not fit; cp = 8 does.
    With the loss on vocabulary-sharded logits (the default) TP 8 fits too, at a few GiB more
    than cp 8 (its vocabulary shard's temporaries), and is still ranked below it."""
    monkeypatch.setenv("HSDP_RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    code = plan.main(
        LONG_8B
        + [
            "parallel.loss_parallel=false",
            "plan.cp_degrees=[1,8]",
            f"plan.out_dir={tmp_path / 'plan'}",
        ]
    )
    assert code == 0
    layouts = json.loads((tmp_path / "plan" / "plan.json").read_text())["layouts"]
    by_cp = {e["overrides"]["parallel.cp"]: e for e in layouts if e["valid"]}
    assert set(by_cp) == {1, 8}
    assert by_cp[8]["rank"] == 1 and by_cp[8]["fits"] and by_cp[8]["layout"] == "fsdp_cp"
    assert not by_cp[1]["fits"] and by_cp[1]["overrides"]["parallel.tp"] == 8
    assert by_cp[8]["exposed_comm_s"]["cp"] > 0
    assert "| 1 | 1×1×8×1 |" in capsys.readouterr().out
    cfg = plan.compose(LONG_8B)
    run = to_run_config(cfg)
    cluster = resolve(run.cluster, run.precision.param_dtype)
    tp8 = layouts_mod.plan_layouts(
        cfg, cluster, {}, {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 8}
    )
    assert tp8[0]["fits"]
    assert by_cp[8]["mem_gib"] < tp8[0]["mem_gib"] < by_cp[8]["mem_gib"] + 10
    assert tp8[0]["step_time_s"] > by_cp[8]["step_time_s"]


def test_activation_collectives_move_the_same_bytes_whatever_the_micro_batches():
    """TP's and cp's collectives move the step's tokens once per pass: grad accumulation splits
    them into more calls, not more bytes (full AC's recomputed gathers included)."""
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=2, world_size=8)
    per_accum = {}
    for accum in (1, 2):
        cfg = plan.compose(
            LONG
            + [
                "parallel.ac=full",
                "trainer.global_batch_size=4",
                f"trainer.grad_accum_steps={accum}",
            ]
        )
        per_accum[accum] = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
    for key in ("all_gather/tp", "reduce_scatter/tp", "all_gather/cp", "reduce_scatter/cp"):
        one, two = per_accum[1][key], per_accum[2][key]
        assert two["bytes"] == one["bytes"] and two["calls"] == 2 * one["calls"], key


@pytest.mark.parametrize("overlap", [1.0, 0.0])
def test_the_attention_input_gathered_again_runs_beside_the_attention_backward(overlap):
    """TP 4 with sequence parallel saving shards (``parallel.sp_save_shard``): backward
    gathers each block's attention and feed-forward input again, equal gathers. The
    attention's starts at the output projection's backward and runs beside the attention
    backward (``sp_saves``), which at 4,096 tokens outlasts it: hidden with
    ``cluster.overlap`` 1, exposed with 0; the feed-forward's is exposed either way."""
    base = [*TINY, "model.n_layers=2", "model.seq_len=4096", "precision=bf16", "parallel.tp=4"]
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=4, world_size=4)
    cluster = _cluster(overlap=overlap)
    times = {}
    for save in (False, True):
        cfg = plan.compose([*base, f"parallel.sp_save_shard={save}"])
        times[save] = step_time(cfg, dims, cluster)
        regather = attention_regather_comm(
            cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer
        )
    tokens = 8 * 4096  # the rank's tokens a step: no dp
    assert regather == {"all_gather/tp": {"calls": 2, "bytes": 2 * tokens * 64 * 2}}
    one_kind = sum(comm_times(regather, dims, cluster).values())
    attention_backward = 2 / 3 * times[True]["compute_parts_s"]["attention"]
    assert attention_backward > one_kind  # the long sequence's attention hides it
    grown = times[True]["exposed_comm_s"]["tp"] - times[False]["exposed_comm_s"]["tp"]
    assert grown == pytest.approx(one_kind * (1 if overlap else 2), rel=1e-9)
