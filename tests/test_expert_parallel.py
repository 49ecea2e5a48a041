"""Expert parallel's pieces on their own: the degree and its errors, the expert meshes on real
gloo groups (reused where their ranks are an existing group's), and the token exchange
against the same routing computed in one process (forward, order and gradients)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from conftest import read_job, run_cli
from distributed import run_workers

from hsdp_runner.config.schema import ParallelConfig
from hsdp_runner.core.errors import ConfigError
from hsdp_runner.distributed.parallel_dims import ParallelDims

MOE = NS(name="moe_tiny", n_heads=4, n_kv_heads=2, seq_len=32, n_layers=3, n_experts=8)
DENSE = NS(name="llama3_tiny", n_heads=4, n_kv_heads=2, seq_len=32, n_layers=2)


def dims(r=1, s=1, c=1, t=1, ep=1, model=MOE, pp=1, sp=True):
    parallel = ParallelConfig(
        pp=pp, dp_replicate=r, dp_shard=s, cp=c, tp=t, ep=ep, sequence_parallel=sp
    )
    return ParallelDims.from_config(parallel, model, pp * r * s * c * t)


@pytest.mark.parametrize(
    "degrees, layout, efsdp, groups",
    [
        # ep splits dp_shard: two new dims (efsdp, ep) unflattened from it.
        ({"s": 4, "ep": 2}, "fsdp_ep", 2, ("dp_shard", "efsdp", "ep")),
        # ep is a whole dim or a run of the innermost ones: an existing group.
        ({"s": 2, "ep": 2}, "fsdp_ep", 1, ("dp_shard", "pp", "dp_shard")),
        ({"s": 2, "t": 2, "ep": 2}, "fsdp_tp_ep", 2, ("dp_shard_cp_tp", "dp_shard", "tp")),
        ({"s": 2, "c": 2, "ep": 2}, "fsdp_cp_ep", 2, ("dp_shard_cp", "dp_shard", "cp")),
        ({"r": 2, "s": 2, "ep": 2}, "hsdp_ep", 1, ("dp_shard", "pp", "dp_shard")),
        ({"c": 2, "t": 2, "ep": 4}, "fsdp_cp_tp_ep", 1, ("dp_shard_cp_tp", "pp", "dp_shard_cp_tp")),
        # No expert parallel: the experts shard over every rank holding distinct tokens.
        ({"t": 2}, "tp", 2, ("tp", "tp", "pp")),
    ],
)
def test_ep_borrows_its_ranks_innermost_from_shard_cp_tp(degrees, layout, efsdp, groups):
    d = dims(**degrees)
    assert (d.layout, d.efsdp, d.ep * d.efsdp) == (layout, efsdp, d.dp_shard_cp_tp)
    assert d.world_size == d.pp * d.dp_replicate * d.dp_shard_cp_tp  # ep multiplies nothing
    assert tuple(d.same_group(n) for n in ("dp_shard_cp_tp", "efsdp", "ep")) == groups
    assert d.describe()["ep"] == d.ep and d.moe


def test_a_dense_model_builds_no_expert_meshes_and_keeps_its_layout_name():
    d = dims(s=4, model=DENSE)
    assert not d.moe and d.layout == "fsdp" and d.describe()["ep"] == 1


@pytest.mark.parametrize(
    "degrees, words",
    [
        ({"s": 4, "ep": 0}, "parallel.ep=0 is invalid; use a positive degree"),
        ({"s": 4, "ep": -1}, "It is never inferred (-1)"),
        (
            {"s": 2, "t": 2, "ep": 3},
            "parallel.ep=3 does not divide parallel.dp_shard x parallel.cp x parallel.tp = "
            "2 x 1 x 2 = 4",
        ),
        ({"s": 2, "ep": 2, "model": DENSE}, "model=llama3_tiny is dense (no model.n_experts)"),
        (
            {"s": 2, "t": 2, "ep": 4, "model": NS(**{**vars(MOE), "n_experts": 6})},
            "parallel.ep=4 does not divide model.n_experts=6",
        ),
    ],
)
def test_bad_expert_degrees_name_the_keys_and_fix(degrees, words):
    with pytest.raises(ConfigError) as err:
        dims(**degrees)
    assert words in str(err.value)


# --- on gloo ranks ---------------------------------------------------------------------------

MESH_CASES = {  # name: degrees on 4 ranks
    "fsdp4_ep2": {"s": 4, "ep": 2},
    "fsdp2_tp2_ep2": {"s": 2, "t": 2, "ep": 2},
    "hsdp_ep2": {"r": 2, "s": 2, "ep": 2},
    "cp2_tp2_ep4": {"c": 2, "t": 2, "ep": 4},
}


def _group_ranks(mesh) -> list[int]:
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(mesh.get_group()))


def _meshes() -> dict:
    """Per ``MESH_CASES`` layout: the ranks of this rank's efsdp, ep, dp_shard_cp_tp and cp_tp
    groups, whether ep's mesh is an existing one, and the HSDP mesh of the experts."""
    out = {}
    for name, degrees in MESH_CASES.items():
        d = dims(**degrees)
        world = d.build_mesh("cpu")
        groups = {n: _group_ranks(world[n]) for n in ("efsdp", "ep", "dp_shard_cp_tp", "cp_tp")}
        experts_mesh = world.fsdp_mesh(d.dp_replicate > 1, "efsdp")
        out[name] = {
            **groups,
            "ep_is_tp": world["ep"].get_group() is world.root["tp"].get_group(),
            "experts_mesh": tuple(experts_mesh.mesh.shape),
        }
    return out


def _exchange(ep: int, dtype) -> dict:
    """On 4 ranks, ep groups of ``ep`` (innermost): each rank routes random token copies to 8
    experts (uneven, some experts empty); dispatch, an expert-dependent map, combine, backward.
    Returns the largest differences from the reference computed from every rank's inputs."""
    import torch.distributed as dist

    from hsdp_runner.distributed.expert_parallel import TokenExchange

    d = dims(s=4, ep=ep)
    world = d.build_mesh("cpu")
    rank, n_experts, dim = dist.get_rank(), 8, 16
    gen = torch.Generator().manual_seed(10 + rank)
    counts = torch.randint(0, 4, (n_experts,), generator=gen) * (torch.rand(8, generator=gen) > 0.3)
    tokens = torch.randn(int(counts.sum()), dim, generator=gen).to(dtype)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (counts, tokens))
    peers = _group_ranks(world["ep"])  # in ep order
    me, local = peers.index(rank), n_experts // ep
    # The reference: each local expert's rows from every ep peer in ep order.
    expected = []
    for expert in range(me * local, (me + 1) * local):
        for peer in peers:
            c, x = every[peer]
            start = int(c[:expert].sum())
            expected.append(x[start : start + int(c[expert])])
    expected = torch.cat(expected)
    x = tokens.clone().requires_grad_()
    exchange = TokenExchange(world["ep"])
    got, local_counts, state = exchange.dispatch(x, counts)
    expert_of_row = torch.repeat_interleave(torch.arange(local) + me * local, local_counts)
    out = exchange.combine(got * (expert_of_row + 1).to(dtype)[:, None], state)
    weights = torch.randn(out.shape, generator=gen).to(dtype)
    (out * weights).sum().backward()
    scale = (torch.repeat_interleave(torch.arange(n_experts), counts) + 1).to(dtype)[:, None]
    return {
        "dispatch": (got - expected).abs().max().item() if got.numel() else 0.0,
        "counts": local_counts.tolist()
        == [sum(int(every[p][0][e]) for p in peers) for e in range(me * local, (me + 1) * local)],
        "combine": (out - tokens * scale).abs().max().item() if out.numel() else 0.0,
        "grad": (x.grad - weights * scale).abs().max().item() if out.numel() else 0.0,
        "rows": (tokens.shape[0], got.shape[0]),
    }


def _stage_buffers() -> list[float]:
    """pp 2 x dp_shard 2: each stage's chunk has its own number of buffers (as a mixture of
    experts' stages hold different numbers of routers), each rank's values its own; returns
    them after ``sync_buffers``."""
    import torch.distributed as dist
    from torch import nn

    from hsdp_runner.distributed.parallelize import sync_buffers

    d = dims(pp=2, s=2, model=DENSE)
    world = d.build_mesh("cpu")
    stage, rank = world.local_rank_in("pp"), dist.get_rank()
    chunk = nn.Module()
    for i in range(1 + 2 * stage):  # 1 buffer on stage 0, 3 on stage 1
        chunk.register_buffer(f"b{i}", torch.full((2,), float(rank)))
    sync_buffers(chunk, world)
    return [float(b[0]) for b in chunk.buffers()]


def _skipped_step_bias() -> dict:
    """The balance step over one real moe_tiny layer per rank, fed uneven counts: its bias
    after a step the optimizer skipped (applied 0) and after one it applied (applied 1)."""
    from test_config import compose

    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.distributed.expert_balance import balance_step
    from hsdp_runner.models.base import model_spec

    spec = model_spec(to_run_config(compose(["model=moe_tiny"])).model)
    model = spec.build()
    with torch.device("meta"):
        meta = spec.build()
    balance = balance_step([model], meta, spec.n_experts, 0.1, dims(s=4), torch.device("cpu"))
    router = model.moe_layers()[0].router
    counts = torch.arange(spec.n_experts, dtype=torch.float32)
    router.tokens_per_expert.copy_(counts)
    balance(torch.tensor(0.0))
    skipped = router.expert_bias.clone()
    router.tokens_per_expert.copy_(counts)
    balance(torch.tensor(1.0))
    return {"skipped": skipped.abs().max().item(), "applied": router.expert_bias.tolist()}


def _four_rank_cases() -> dict:
    return {
        "skipped_step_bias": _skipped_step_bias(),
        "stage_buffers": _stage_buffers(),
        "meshes": _meshes(),
        "exchange_ep4": _exchange(4, torch.float32),
        "exchange_ep2": _exchange(2, torch.float32),
        "exchange_ep2_bf16": _exchange(2, torch.bfloat16),
    }


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return run_workers(_four_rank_cases, 4)


@pytest.mark.multiprocess
def test_expert_meshes_group_ranks_with_ep_innermost(four_ranks):
    by_rank = {rank: result["meshes"] for rank, result in four_ranks.items()}
    # dp_shard 4 split (2, 2): ep groups are neighbours, efsdp every other rank.
    assert by_rank[0]["fsdp4_ep2"]["ep"] == [0, 1] and by_rank[2]["fsdp4_ep2"]["ep"] == [2, 3]
    assert by_rank[0]["fsdp4_ep2"]["efsdp"] == [0, 2] and by_rank[1]["fsdp4_ep2"]["efsdp"] == [1, 3]
    # ep = tp: the tp group itself; efsdp = dp_shard; the router's group all four ranks.
    case = by_rank[1]["fsdp2_tp2_ep2"]
    assert case["ep_is_tp"] and case["ep"] == [0, 1] and case["efsdp"] == [1, 3]
    assert case["dp_shard_cp_tp"] == [0, 1, 2, 3] and case["cp_tp"] == [0, 1]
    # HSDP: ep inside each replica; the experts' mesh (dp_replicate, efsdp = 1).
    case = by_rank[3]["hsdp_ep2"]
    assert case["ep"] == [2, 3] and case["efsdp"] == [3] and case["experts_mesh"] == (2, 1)
    case = by_rank[2]["cp2_tp2_ep4"]
    assert case["ep"] == [0, 1, 2, 3] and case["cp_tp"] == [0, 1, 2, 3] and case["efsdp"] == [2]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["exchange_ep4", "exchange_ep2"])
def test_token_exchange_matches_routing_in_one_process(four_ranks, case):
    for rank, result in four_ranks.items():
        got = result[case]
        assert got["counts"], (rank, got)
        assert got["dispatch"] == 0.0 and got["combine"] == 0.0, (rank, got)
        assert got["grad"] <= 1e-6, (rank, got)
    # Uneven: the ranks send and receive different numbers of rows.
    assert len({result[case]["rows"] for result in four_ranks.values()}) > 1


@pytest.mark.multiprocess
def test_token_exchange_carries_bf16(four_ranks):
    for result in four_ranks.values():
        got = result["exchange_ep2_bf16"]
        assert got["dispatch"] == 0.0 and got["combine"] == 0.0 and got["grad"] <= 1e-2


@pytest.mark.multiprocess
def test_moe_trains_with_expert_parallel_from_the_command_line(job_dir):
    result = run_cli(job_dir, "model=moe_tiny", "parallel=fsdp", "parallel.ep=2", "trainer.steps=3")
    assert result.returncode == 0, result.stderr[-3000:]
    records, summary = read_job(job_dir)
    assert (summary["layout"], summary["ep"], summary["world_size"]) == ("fsdp_ep", 2, 4)
    assert len(records) == 3
    figures = {"moe/aux_loss", "moe/load_max_over_mean", "moe/load_max_over_mean/layer_2"}
    assert figures <= set(records[-1]), sorted(records[-1])
    assert all(1.0 <= r["moe/load_max_over_mean"] <= 8 / 2 for r in records)


@pytest.mark.multiprocess
def test_buffers_sync_within_each_pipeline_stage(four_ranks):
    """Ranks 0, 1 hold stage 0 and ranks 2, 3 stage 1: each stage's buffers come from its
    first rank, whatever the other stage holds."""
    got = {rank: result["stage_buffers"] for rank, result in four_ranks.items()}
    assert got == {0: [0.0], 1: [0.0], 2: [2.0] * 3, 3: [2.0] * 3}


@pytest.mark.multiprocess
def test_a_skipped_step_leaves_the_balancing_bias_as_the_weights(four_ranks):
    """A step the optimizer skipped as non-finite moves no bias; an applied one moves every
    expert's by the speed, against its load (the busiest down, the idlest up)."""
    for result in four_ranks.values():
        got = result["skipped_step_bias"]
        assert got["skipped"] == 0.0, got
        assert got["applied"][0] == pytest.approx(0.1) and got["applied"][-1] == pytest.approx(-0.1)


@pytest.mark.parametrize("gpus", [0, 1])
def test_float8_with_experts_is_refused_on_either_device(gpus):
    """On the CPU torchao's grouped float8 does not run; on a GPU the experts would stay in
    bf16 while the dense linears went float8: refused rather than half applied."""
    from test_config import compose

    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.distributed.float8 import check_experts

    run = to_run_config(compose(["model=moe_tiny", "precision=float8"]))
    words = "runs on GPUs only" if not gpus else "not converted to float8 yet"
    with pytest.raises(ConfigError, match=words):
        check_experts(run.precision, run.model, gpus)
    dense = to_run_config(compose(["model=llama3_tiny", "precision=float8"]))
    check_experts(dense.precision, dense.model, gpus)  # a dense model: nothing to refuse
