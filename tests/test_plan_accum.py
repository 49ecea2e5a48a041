"""Gradient accumulation in the plan's step time: the gradients are reduced once (the memory side,
per ``trainer.accum_reduce``, is in tests/test_plan_memory.py)."""

from clusters import fake_cluster

from hsdp_runner import plan
from hsdp_runner.distributed.comm_model import analytic_comm
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.planner.step_time import comm_times, step_time


def _dims(rep: int, shard: int, tp: int, world: int, node: int) -> ParallelDims:
    return ParallelDims(
        dp_replicate=rep, dp_shard=shard, tp=tp, world_size=world, ranks_per_node=node
    )


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
