"""Gradient accumulation in the plan's step time: each ``trainer.accum_reduce`` priced, a
reduce-scatter per micro-batch (every) or one (last), the replicate all-reduce once;
``parallel=auto`` plans both. The memory side, per ``trainer.accum_reduce``, is in
tests/test_plan_memory.py."""

import pytest
from clusters import fake_cluster

from hsdp_runner import plan
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.distributed.comm_model import analytic_comm, unit_sizes
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.planner import auto, mem_phases
from hsdp_runner.planner import memory as plan_memory
from hsdp_runner.planner.layouts import plan_layouts
from hsdp_runner.planner.step_time import comm_times, step_time

TINY = ["model=llama3_tiny", "model.n_layers=1", "cluster.gpus_per_node=4"]
BIG = ["model=llama3_8b", "precision=bf16", "model.seq_len=2048", "trainer.global_batch_size=16"]


def _dims(rep: int, shard: int, tp: int, world: int, node: int) -> ParallelDims:
    return ParallelDims(
        dp_replicate=rep, dp_shard=shard, tp=tp, world_size=world, ranks_per_node=node
    )


@pytest.mark.parametrize("choice", ["every", "last"])
def test_the_replicate_all_reduce_hides_behind_the_last_micro_batch_backward_alone(choice):
    """HSDP 2 x 4 on 2 nodes whose NICs make the replicate all-reduce slower than one
    micro-batch's backward: every accumulation step all-reduces the same gradient bytes once
    (after the last micro-batch, whatever ``trainer.accum_reduce``), but it can hide only behind
    the last micro-batch's backward (1/N of the compute), so at least
    all-reduce - backward / N is exposed, and more micro-batches expose more."""
    dims = _dims(2, 4, 1, 8, 4)
    cluster = fake_cluster(nic_gbit=20.0)  # overlap 1.0
    exposed, reduced = [], []
    for accum in (1, 2, 4):
        cfg = plan.compose(
            [
                *BIG,
                f"trainer.grad_accum_steps={accum}",
                f"trainer.accum_reduce={choice}",
            ]
        )
        comm = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
        reduced.append(comm["all_reduce/dp_replicate"])
        all_reduce = comm_times(comm, dims, cluster)["all_reduce/dp_replicate"]
        result = step_time(cfg, dims, cluster)
        backward = 2 * result["compute_s"] / 3
        sync = result["exposed_comm_s"]["dp_replicate"] + result["exposed_comm_s"]["dp_shard"]
        assert all_reduce > backward / 2
        assert sync >= all_reduce - backward / accum
        exposed.append(result["step_time_s"] - result["compute_s"])
    assert reduced[0] == reduced[1] == reduced[2]
    assert exposed[0] < exposed[1] < exposed[2]


def test_a_reduce_scatter_per_micro_batch_hides_behind_its_own_backward():
    """FSDP over 8 ranks on 2 nodes with slow NICs, 4 micro-batches: with ``every`` each
    micro-batch reduce-scatters the whole gradients (4 times the bytes of ``last``) and hides
    its reduce-scatter behind its own backward (a quarter of the compute), so each of the 3
    earlier micro-batches exposes at least a reduce-scatter minus its backward more than
    ``last``. On one node (NVLink) the reduce-scatters hide but for the root's, exposed in
    each micro-batch."""
    accum = 4
    for dims, cluster in (
        (_dims(1, 8, 1, 8, 4), fake_cluster(nic_gbit=20.0)),
        (_dims(1, 4, 1, 4, 4), fake_cluster(nodes=1)),
    ):
        got = {}
        for choice in ("every", "last"):
            cfg = plan.compose(
                [*BIG, f"trainer.grad_accum_steps={accum}", f"trainer.accum_reduce={choice}"]
            )
            comm = analytic_comm(cfg.model, dims, cfg.parallel, cfg.precision, cfg.trainer)
            got[choice] = (comm, comm_times(comm, dims, cluster), step_time(cfg, dims, cluster))
        every, last = got["every"], got["last"]
        assert (
            every[0]["reduce_scatter/dp_shard"]["bytes"]
            == accum * last[0]["reduce_scatter/dp_shard"]["bytes"]
        )
        one_reduce_scatter = last[1]["reduce_scatter/dp_shard"]
        backward_pass = 2 * last[2]["compute_s"] / 3 / accum
        more = every[2]["step_time_s"] - last[2]["step_time_s"]
        assert every[2]["compute_s"] == last[2]["compute_s"]
        if dims.world_size == 8:
            assert one_reduce_scatter > backward_pass
            assert more >= (accum - 1) * (one_reduce_scatter - backward_pass) > 0
        else:
            units = unit_sizes(cfg.model, dims)
            root = units["root"][0] / sum(u[0] for u in units.values())
            assert more == pytest.approx((accum - 1) * one_reduce_scatter * root, rel=1e-6)


def test_both_choices_are_planned_as_an_axis_and_auto_plans_them(tmp_path, monkeypatch):
    """``plan.axes.trainer.accum_reduce=every,last`` (what ``parallel=auto`` plans when a step
    has several micro-batches and the command line does not choose) gives a row per choice:
    across nodes ``last`` is faster (one reduce-scatter a step); the chosen row's overrides
    carry the choice into the job's config. (Memory is not what this checks: the fake
    measurements are replaced by empty ones, so no child process starts.)"""
    monkeypatch.setattr(plan_memory, "measure", lambda requests: [{} for _ in requests])
    monkeypatch.setattr(mem_phases, "extrapolate", lambda measured, n_layers: {"0/loss": {}})
    accum = ["trainer.global_batch_size=16", "trainer.grad_accum_steps=2"]
    cfg = plan.compose(TINY + accum)
    run = to_run_config(cfg)
    axes = auto.planned_axes(run, [])
    assert axes == {"trainer.accum_reduce": ["every", "last"]}
    assert auto.planned_axes(run, ["trainer.accum_reduce=last"]) == {}
    one = to_run_config(plan.compose(TINY + ["trainer.global_batch_size=8"]))
    assert auto.planned_axes(one, []) == {}
    fsdp = {"dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1}
    rows = plan_layouts(cfg, fake_cluster(nic_gbit=20.0), axes, fsdp)
    by_choice = {row["overrides"]["trainer.accum_reduce"]: row for row in rows}
    assert set(by_choice) == {"every", "last"}
    assert by_choice["every"]["step_time_s"] > by_choice["last"]["step_time_s"]
    best, _ = auto.choose(rows)
    assert best is by_choice["last"]
    job = plan.compose(TINY + accum)
    auto.apply_choice(job, best["overrides"], tmp_path / "plan.json", {"name": "t"})
    assert job.trainer.accum_reduce.value == "last"
