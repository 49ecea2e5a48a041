"""Gradient accumulation in the plan: the fake memory step runs every micro-batch as the trainer
does (gradient sync off but for the last), and the step time reduces the gradients once."""

from clusters import fake_cluster
from omegaconf import OmegaConf

from hsdp_runner import plan
from hsdp_runner.distributed.comm_model import analytic_comm, unit_sizes
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.planner import memory as plan_memory
from hsdp_runner.planner.layouts import plan_layouts
from hsdp_runner.planner.step_time import comm_times, step_time

TINY = ["model=llama3_tiny", "model.n_layers=1", "cluster.gpus_per_node=4"]


def _dims(rep: int, shard: int, tp: int, world: int, node: int) -> ParallelDims:
    return ParallelDims(
        dp_replicate=rep, dp_shard=shard, tp=tp, world_size=world, ranks_per_node=node
    )


def test_accumulation_holds_every_unsharded_gradient_until_the_last_micro_batch(
    tmp_path, monkeypatch
):
    """With gradient sync off, FSDP2 keeps each parameter's unsharded gradient (one TP rank's
    part, fp32 here) across micro-batches and reduce-scatters it in the last one: at the peak
    of a 2-micro-batch step the tracker holds exactly the model's gradients, unsharded, on
    every wrapper (FSDP, the FSDP-based DDP, FSDP x TP; there plus the output layer's fresh
    gradient). A plan with accumulation runs and
    its peak grows by no more than those gradients over one micro-batch without it."""
    monkeypatch.setenv("HSDP_RUNNER_CACHE_DIR", str(tmp_path))
    cfg = plan.compose(TINY + ["trainer.global_batch_size=8", "trainer.grad_accum_steps=2"])
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    shapes = [(1, 4, 1, 1), (4, 1, 1, 1), (1, 2, 1, 2)]
    requests = [
        plan_memory.request(
            plain["model"], plain["parallel"], plain["precision"], [], shape, 1, 2, 4, 4, 1
        )
        for shape in shapes
    ]
    measured = plan_memory.measure(requests, use_disk_cache=False)
    for shape, cats in zip(shapes, measured):
        units = unit_sizes(cfg.model, _dims(1, 1, shape[3], shape[3], 4))
        held = 4 * sum(u[1] for u in units.values())
        # At the peak one unit's fresh gradient may exist beside its accumulated one (under TP
        # the peak falls in the root's backward: the output layer's new gradient).
        fresh = 4 * max(u[1] for u in units.values())
        assert held <= cats["unsharded_grad"] <= held + fresh, shape
        if shape[3] == 1:  # FSDP and DDP peak with exactly the accumulated gradients
            assert cats["unsharded_grad"] == held, shape

    fsdp = {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}
    cluster = fake_cluster(nodes=1)
    one = plan_layouts(plan.compose(TINY + ["trainer.global_batch_size=4"]), cluster, {}, fsdp)
    two = plan_layouts(cfg, cluster, {}, fsdp)  # the same micro-batch of 1, twice
    grown = (two[0]["mem_gib"] - one[0]["mem_gib"]) * plan_memory.GIB
    whole = unit_sizes(cfg.model, _dims(1, 1, 1, 1, 4))
    assert 0 < grown <= 4 * sum(u[1] for u in whole.values())


def test_gradients_reduced_once_hide_behind_the_last_micro_batch_backward_alone():
    """HSDP 2 x 4 on 2 nodes whose NICs make the replicate all-reduce slower than one
    micro-batch's backward: every accumulation step moves the same gradient bytes once, but it
    can hide only behind the last micro-batch's backward (1/N of the compute), so at least
    all-reduce - backward / N is exposed, and more micro-batches expose more."""
    dims = _dims(2, 4, 1, 8, 4)
    cluster = fake_cluster(nic_gbit=20.0)  # overlap 1.0
    exposed, reduced = [], []
    for accum in (1, 2, 4):
        cfg = plan.compose(
            [
                "model=llama3_8b",
                "precision=bf16",
                "model.seq_len=2048",
                "trainer.global_batch_size=16",
                f"trainer.grad_accum_steps={accum}",
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
