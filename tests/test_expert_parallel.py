"""Expert parallel's pieces on their own: the degree and its errors, the expert meshes on real
gloo groups (reused where their ranks are an existing group's), and the token exchange
against the same routing computed in one process (forward, order and gradients)."""

from __future__ import annotations

import re
from types import SimpleNamespace as NS

import pytest
import torch
from conftest import read_job, run_cli
from distributed import own_groups, run_workers

from hsdp_runner.config.schema import ParallelConfig
from hsdp_runner.core.choices import Dtype, ExchangeOrder
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


def _exchange(ep: int, dtype, ranks_per_node: int | None = None, top_k: int = 2) -> dict:
    """On 4 ranks, ep groups of ``ep`` (innermost) on nodes of ``ranks_per_node`` (None: one
    node; an ep group spanning nodes exchanges by node): each rank routes 6 tokens to
    ``top_k`` of 8 experts (random: some experts get none), weighed at random; dispatch, an
    expert-dependent map, combine, backward. Returns the largest differences from the rows
    every peer routed (dispatch) and from the same routing summed in this process (combine,
    the tokens' and weights' gradients)."""
    import torch.distributed as dist

    from hsdp_runner.distributed.expert_parallel import make_exchange
    from hsdp_runner.models.moe_routing import LocalExchange, expert_counts, sum_copies

    d = ParallelDims.from_config(ParallelConfig(dp_shard=4, tp=1, ep=ep), MOE, 4, ranks_per_node)
    world = d.build_mesh("cpu")
    exchange = make_exchange(d, world)
    rank, n_experts, dim, n_tokens = dist.get_rank(), 8, 16, 6
    gen = torch.Generator().manual_seed(10 + rank)
    chosen = torch.stack([torch.randperm(n_experts, generator=gen)[:top_k] for _ in range(6)])
    tokens = torch.randn(n_tokens, dim, generator=gen).to(dtype)
    weight = torch.rand(n_tokens * top_k, generator=gen)
    upstream = torch.randn(n_tokens, dim, generator=gen).to(dtype)
    order = chosen.flatten().argsort(stable=True)
    token, counts = order // top_k, expert_counts(chosen, n_experts)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (counts, tokens[token]))
    peers = _group_ranks(world["ep"])  # in ep order
    me, local = peers.index(rank), n_experts // ep
    x, w = tokens.clone().requires_grad_(), weight.clone().requires_grad_()
    got, local_counts, got_weight, state = exchange.dispatch(x, token, counts, w[order])
    expert_of_row = torch.repeat_interleave(torch.arange(local) + me * local, local_counts)
    # The "experts": each row times its expert's id + 1, weighed by its arrived weight.
    weighed = got * (expert_of_row + 1).to(dtype)[:, None] * got_weight[:, None]
    out = exchange.combine(weighed.to(dtype), state, sum_copies)
    (out * upstream).sum().backward()
    # The reference: each local expert's rows from every ep peer (in any order within the
    # expert: the by-node exchange brings them by relay, then source node).
    dispatch, start = 0.0, 0
    for expert in range(me * local, (me + 1) * local):
        rows = []
        for peer in peers:
            c, copies = every[peer]
            first = int(c[:expert].sum())
            rows.append(copies[first : first + int(c[expert])])
        want = torch.cat(rows)
        have = got[start : start + want.shape[0]].detach()
        start += want.shape[0]
        if want.numel():
            by_value = lambda t: t[t[:, 0].float().argsort()]  # noqa: E731
            dispatch = max(dispatch, (by_value(have) - by_value(want)).abs().max().item())
    xr, wr = tokens.clone().requires_grad_(), weight.clone().requires_grad_()
    scale = (chosen.flatten()[order] + 1).to(dtype)[:, None]
    state = (token, n_tokens, dtype)
    ref = LocalExchange().combine(
        (xr[token] * scale * wr[order][:, None]).to(dtype), state, sum_copies
    )
    (ref * upstream).sum().backward()
    return {
        "kind": type(exchange).__name__,
        "dispatch": dispatch,
        "counts": local_counts.tolist()
        == [sum(int(every[p][0][e]) for p in peers) for e in range(me * local, (me + 1) * local)],
        "combine": (out - ref).abs().max().item(),
        "grad": (x.grad - xr.grad).abs().max().item(),
        "weight_grad": (w.grad - wr.grad).abs().max().item(),
        "rows": (token.numel(), got.shape[0]),
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


def _skipped_step_bias(cfg) -> dict:
    """The balance step over one real moe_tiny layer per rank (``cfg``: the preset's typed
    config), fed uneven counts: its bias after a step the optimizer skipped (applied 0) and
    after one it applied (applied 1)."""
    from hsdp_runner.distributed.expert_balance import balance_step
    from hsdp_runner.models.base import model_spec

    spec = model_spec(cfg.model)
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


class _CrossNodeBytes:
    """A dispatch mode that adds up what the all-to-alls under it send to ranks of other
    nodes (rank r on node r // ``ranks_per_node``), from each call's input and split sizes:
    {'rows': bytes of 2-D inputs (token rows), 'routing': of 1-D ones (counts, copies'
    slots, weights)}."""

    def __new__(cls, ranks_per_node: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.sent = {"rows": 0, "routing": 0}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch.distributed as dist
                from torch.distributed.distributed_c10d import _resolve_process_group

                if func._overloadpacket == torch.ops._c10d_functional.all_to_all_single:
                    rows, _, splits, group = args
                    ranks = dist.get_process_group_ranks(_resolve_process_group(group))
                    splits = splits or [rows.shape[0] // len(ranks)] * len(ranks)
                    row = rows[:1].numel() * rows.element_size()
                    mine = dist.get_rank() // ranks_per_node
                    crossing = sum(n for r, n in zip(ranks, splits) if r // ranks_per_node != mine)
                    self.sent["rows" if rows.dim() == 2 else "routing"] += crossing * row
                return func(*args, **(kwargs or {}))

        return Mode()


def _cross_node_bytes() -> dict:
    """ep 4 over 2 nodes of 2 (ep rank r holds experts 2r, 2r + 1): each rank's 5 tokens go
    to one expert of every ep rank, two per node. What the flat exchange and the by-node one
    send across nodes in one dispatch, combine and backward ({exchange: _CrossNodeBytes})."""
    from hsdp_runner.distributed.expert_parallel import TokenExchange, make_exchange
    from hsdp_runner.models.moe_routing import expert_counts, sum_copies

    d = ParallelDims.from_config(ParallelConfig(dp_shard=4, tp=1, ep=4), MOE, 4, 2)
    world = d.build_mesh("cpu")
    n_tokens, dim, top_k = 5, 16, 4
    gen = torch.Generator().manual_seed(0)
    chosen = torch.tensor([[2 * r + (t + r) % 2 for r in range(4)] for t in range(n_tokens)])
    order = chosen.flatten().argsort(stable=True)
    token, counts = order // top_k, expert_counts(chosen, 8)
    out = {}
    for exchange in (TokenExchange(world["ep"]), make_exchange(d, world)):
        x = torch.randn(n_tokens, dim, generator=gen, requires_grad=True)
        w = torch.rand(n_tokens * top_k, generator=gen, requires_grad=True)
        with _CrossNodeBytes(2) as mode:
            local, _, local_weight, state = exchange.dispatch(x, token, counts, w[order])
            summed = exchange.combine(local * 2.0 * local_weight[:, None], state, sum_copies)
            summed.sum().backward()
        out[type(exchange).__name__] = mode.sent
    return out


def _train_config(ep: int, *extra: str):
    """The typed config of moe_tiny under FSDP 4 with ``ep`` and the ``extra`` overrides, 3
    steps (composed once, in the test's process, not on every rank)."""
    from test_config import compose

    from hsdp_runner.config.compose import to_run_config

    overrides = ["model=moe_tiny", "parallel=fsdp", f"parallel.ep={ep}", "logger=none", *extra]
    return to_run_config(compose([*overrides, "trainer.steps=3", "metrics.peak_tflops=1"]))


def _train(cfg, ranks_per_node: int | None) -> dict:
    """Train ``cfg`` (``_train_config``) on these ranks, told they sit on nodes of
    ``ranks_per_node``: the step records and the order each MoE layer's exchange runs its
    chunks in."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from hsdp_runner.distributed.expert_parallel import moe_modules
    from hsdp_runner.runtime.rank_training import rank_trainer

    _clear_sharding_prop_cache()  # a second world in this process (tests/test_comm.py)
    trainer, _ = rank_trainer(cfg, ranks_per_node=ranks_per_node)
    orders = {
        getattr(moe.exchange, "order", None)
        for part in trainer.parts
        for moe in moe_modules(part).values()
    }
    return {"records": trainer.fit(), "orders": orders}


def _chunked_layer(
    ep: int = 2, ranks_per_node: int | None = None, order: str = "breadth_first"
) -> dict:
    """A MoE layer (8 experts, top 2, 16 wide) on ep ``ep`` of 4 ranks (on nodes of
    ``ranks_per_node``: None, one node), forward and backward with its exchange in 2 chunks
    (in ``order``: ``parallel.ep_order``), then in one: the ops' order in each (forward,
    backward: 'A' an all-to-all issued, 'W' one waited by the exchange's own call, 'G'
    grouped matmuls; a
    tensor torch's functional collectives return in flight waits inside the op that first
    uses it, unseen here) and the largest differences of the chunked run's output and
    gradients from the one-piece run's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hsdp_runner.distributed.expert_parallel import _distribute_experts, make_exchange
    from hsdp_runner.models.moe_routing import MoE

    d = ParallelDims.from_config(ParallelConfig(dp_shard=4, ep=ep), MOE, 4, ranks_per_node)
    world = d.build_mesh("cpu")
    torch.manual_seed(0)  # the same weights on every rank: each keeps its own experts
    layer = MoE(
        16,
        8,
        2,
        16,
        0,
        score_func="softmax",
        norm_topk_prob=True,
        route_scale=1.0,
        grouped_mm=True,
        aux_loss_coef=0.0,
        seq_len=8,
    )
    for weight in layer.experts.parameters():
        torch.nn.init.normal_(weight, std=0.3)
    _distribute_experts(layer.experts, world["ep"])
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    x, upstream = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    funcol, aten = torch.ops._c10d_functional, torch.ops.aten
    names = {funcol.all_to_all_single.default: "A", funcol.wait_tensor.default: "W"}
    names[aten._grouped_mm.default] = "G"

    class Order(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in names:
                self.ops.append(names[func])
            return func(*args, **(kwargs or {}))

    runs, orders = {}, {}
    for chunks in (2, 1):
        layer.exchange = make_exchange(d, world, chunks, ExchangeOrder(order))
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        with Order() as forward:
            out = layer(xi)
        with Order() as backward:
            (out * upstream).sum().backward()
        grads = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in layer.parameters()
        ]
        runs[chunks] = (out.detach(), xi.grad, grads)
        orders[chunks] = [re.sub("G+", "G", "".join(o.ops)) for o in (forward, backward)]
    (out2, x2, g2), (out1, x1, g1) = runs[2], runs[1]
    return {
        "order": orders[2],
        "one_piece_order": orders[1],
        "output": (out2 - out1).abs().max().item(),
        "input_grad": (x2 - x1).abs().max().item(),
        "weight_grads": max((a - b).abs().max().item() for a, b in zip(g2, g1)),
    }


def _held_gradient_dtypes(cfg) -> dict:
    """Train one step of ``cfg`` (two micro-batches, the first's gradients held unreduced) and
    return, by unit ('experts': the routed experts', 'dense': the rest), the dtypes FSDP2 held
    the first micro-batch's unsharded gradients in (``FSDPParam.to_accumulated_grad_if_needed``
    runs at each unsynced unit's post-backward)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    held = {"experts": set(), "dense": set()}
    convert = FSDPParam.to_accumulated_grad_if_needed

    def record(self):
        convert(self)
        grad = self.unsharded_accumulated_grad
        if grad is None and self._unsharded_param.grad is not None:
            grad = self._unsharded_param.grad
        if grad is not None:
            held["experts" if ".experts." in self._param_fqn else "dense"].add(str(grad.dtype))

    FSDPParam.to_accumulated_grad_if_needed = record
    try:
        _train(cfg, None)
    finally:
        FSDPParam.to_accumulated_grad_if_needed = convert
    return {unit: sorted(dtypes) for unit, dtypes in held.items()}


def _four_rank_configs() -> dict:
    """The typed configs ``_four_rank_cases`` trains or builds, by case."""
    from test_config import compose

    from hsdp_runner.config.compose import to_run_config

    return {
        "skipped_step_bias": to_run_config(compose(["model=moe_tiny"])),
        "train_ep1": _train_config(1),
        "train_ep4_flat": _train_config(4),
        "train_ep4_2_nodes": _train_config(4, "parallel.ep_order=per_chunk"),
        # ep 4 = dp_shard: no other rank holds a rank's experts (efsdp 1); bf16 master weights.
        "held_grads_ep4_bf16_master": _train_config(
            4,
            "precision=bf16",
            "precision.master_dtype=bfloat16",
            "trainer.grad_accum_steps=2",
            "trainer.accum_reduce=last",
            "trainer.steps=1",
        ),
    }


def _four_rank_cases(configs: dict) -> dict:
    cases = {
        "chunked_layer": lambda: _chunked_layer(),
        "chunked_layer_by_node": lambda: _chunked_layer(4, 2),
        "chunked_layer_by_node_per_chunk": lambda: _chunked_layer(4, 2, "per_chunk"),
        "skipped_step_bias": lambda: _skipped_step_bias(configs["skipped_step_bias"]),
        "stage_buffers": _stage_buffers,
        "meshes": _meshes,
        "exchange_ep4": lambda: _exchange(4, torch.float32),
        "exchange_ep2": lambda: _exchange(2, torch.float32),
        "exchange_ep2_bf16": lambda: _exchange(2, torch.bfloat16),
        # By node: ep 4 over 2 nodes of 2; over 4 nodes of 1 (no second stage), top 3 (two
        # copies of a token on one node); ep 2 over 2 nodes of 1; bf16.
        "exchange_ep4_2_nodes": lambda: _exchange(4, torch.float32, 2),
        "exchange_ep4_4_nodes_top3": lambda: _exchange(4, torch.float32, 1, top_k=3),
        "exchange_ep2_2_nodes": lambda: _exchange(2, torch.float32, 1),
        "exchange_ep4_2_nodes_bf16": lambda: _exchange(4, torch.bfloat16, 2),
        "cross_node_bytes": _cross_node_bytes,
        "train_ep1": lambda: _train(configs["train_ep1"], None),
        "train_ep4_flat": lambda: _train(configs["train_ep4_flat"], None),
        "train_ep4_2_nodes": lambda: _train(configs["train_ep4_2_nodes"], 2),
        "held_grads": lambda: _held_gradient_dtypes(configs["held_grads_ep4_bf16_master"]),
    }
    out = {}
    for name, case in cases.items():
        with own_groups():
            out[name] = case()
    return out


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return run_workers(_four_rank_cases, 4, _four_rank_configs())


@pytest.mark.multiprocess
def test_experts_no_other_rank_holds_accumulate_their_gradients_in_the_master_dtype(four_ranks):
    """With bf16 master weights, a micro-batch's unreduced expert gradients are held in bf16
    where no other rank holds those experts (nothing to reduce: the fp32 reduce dtype would
    only double them), the dense units' in the fp32 reduce dtype, on every rank."""
    for result in four_ranks.values():
        assert result["held_grads"] == {"experts": ["torch.bfloat16"], "dense": ["torch.float32"]}


def test_a_unit_without_peers_reduces_in_no_wider_a_dtype_than_its_master_weights():
    from hsdp_runner.config.schema import PrecisionConfig
    from hsdp_runner.distributed.mixed_precision import mixed_precision_policy

    bf, fp = Dtype.bfloat16, Dtype.float32
    bf16_master = PrecisionConfig(name="p", param_dtype=bf, master_dtype=bf)
    bf16 = PrecisionConfig(name="p", param_dtype=bf, master_dtype=fp)
    low_reduce = PrecisionConfig(name="p", param_dtype=bf, reduce_dtype=bf)
    cases = [(bf16_master, True, torch.float32), (bf16_master, False, torch.bfloat16)]
    cases += [(bf16, False, torch.float32), (low_reduce, False, torch.bfloat16)]
    for precision, reduced, dtype in cases:
        assert mixed_precision_policy(precision, reduced=reduced).reduce_dtype == dtype


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
@pytest.mark.parametrize(
    "case, kind",
    [
        ("exchange_ep4", "TokenExchange"),
        ("exchange_ep2", "TokenExchange"),
        ("exchange_ep4_2_nodes", "NodeExchange"),
        ("exchange_ep4_4_nodes_top3", "NodeExchange"),
        ("exchange_ep2_2_nodes", "NodeExchange"),
    ],
)
def test_token_exchange_matches_routing_in_one_process(four_ranks, case, kind):
    """Flat within a node, by node across nodes: every expert gets its rows from every peer,
    and each token's weighted sum and the gradients of the tokens and the weights are one
    process's. The flat exchange sums a token's copies in one process's order (bit for bit);
    the by-node one sums a node's copies there first (equal to rounding)."""
    for rank, result in four_ranks.items():
        got = result[case]
        assert got["kind"] == kind and got["counts"], (rank, got)
        assert got["dispatch"] == 0.0, (rank, got)
        exact = kind == "TokenExchange"
        for key in ("combine", "grad", "weight_grad"):
            assert got[key] == 0.0 if exact else got[key] <= 1e-5, (rank, key, got)
    # Uneven: the ranks send and receive different numbers of rows.
    assert len({result[case]["rows"] for result in four_ranks.values()}) > 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["exchange_ep2_bf16", "exchange_ep4_2_nodes_bf16"])
def test_token_exchange_carries_bf16(four_ranks, case):
    """bf16 rows; the by-node exchange rounds each node's partial sum to bf16 once more
    before it crosses back (values up to ~20 here: a bf16 ulp is 0.125)."""
    for result in four_ranks.values():
        got = result[case]
        assert got["dispatch"] == 0.0 and got["grad"] <= 1e-2, got
        assert got["combine"] <= (0.0 if case == "exchange_ep2_bf16" else 0.125), got


@pytest.mark.multiprocess
def test_by_node_exchange_sends_a_token_across_nodes_once_per_node(four_ranks):
    """Each token has two experts on the other node: the flat exchange sends both copies
    across (and both outputs back, and their gradients), the by-node one a single row each
    way; both send each copy's fp32 weight (and its gradient back), the by-node one an int64
    slot per copy besides, and the counts."""
    for rank, result in four_ranks.items():
        sent = result["cross_node_bytes"]
        flat, by_node = sent["TokenExchange"], sent["NodeExchange"]
        rows = 5 * 16 * 4  # the rank's 5 tokens, 16 fp32 wide
        # Dispatch, combine, their two gradients: 2 copies a token across (flat), 1 (by node).
        assert flat["rows"] == 4 * 2 * rows and by_node["rows"] == 4 * rows, (rank, sent)
        # Flat: half its 8 int64 counts, the 10 copies' weights (fp32) and their gradients;
        # by node: a node's 4 counts and 1 row count, the 10 copies' slots (int64), weights
        # and the weights' gradients.
        assert flat["routing"] == 4 * 8 + 10 * (4 + 4)
        assert by_node["routing"] == 5 * 8 + 10 * (8 + 4 + 4)


@pytest.mark.multiprocess
def test_by_node_exchange_trains_as_the_flat_one_and_as_ep_1(four_ranks):
    """moe_tiny, FSDP 4, 3 steps: ep 4 with the ranks on 2 nodes of 2 (the by-node exchange,
    its chunks in ``parallel.ep_order=per_chunk``, which the job's exchange runs) against ep 4
    on one node (flat) and ep 1: the same losses and gradient norms (1e-6
    relative) and the same experts' load."""
    runs = {
        key: four_ranks[0][key]["records"]
        for key in ("train_ep1", "train_ep4_flat", "train_ep4_2_nodes")
    }
    assert four_ranks[0]["train_ep4_2_nodes"]["orders"] == {ExchangeOrder.per_chunk}
    by_node = runs["train_ep4_2_nodes"]
    for other in ("train_ep1", "train_ep4_flat"):
        for mine, theirs in zip(by_node, runs[other], strict=True):
            for key in ("loss", "grad_norm", "moe/aux_loss"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-6), (other, key)
            assert mine["moe/load_max_over_mean"] == theirs["moe/load_max_over_mean"], other


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
@pytest.mark.parametrize(
    "case, order, one_piece",
    [
        # Flat, ep 2. Forward: the counts, dispatch 0 and 1 (each its rows and their
        # weights), then per chunk the arrival of both, its experts and its combine; the
        # combines' arrivals last. Backward: both combines' gradients, chunk 1's experts, its
        # dispatch gradients (rows, weights), chunk 0's experts, its dispatch gradients. In
        # one piece the dispatch is used at once, and backward waits each gradient as it
        # comes.
        ("chunked_layer", ["AAAAAWWGAWWGAWW", "AAGAAGAA"], ["AAAGA", "AWGAWAW"]),
        # By node, ep 4 over 2 nodes of 2: both stages' counts, then both chunks' pairs,
        # slots and weights out before the first wait; the relays forward both chunks (rows,
        # then weights), the experts run both, the relays sum both, the sources sum both.
        # Backward: both chunks' sums' and the relays' sums' gradients out before any
        # experts' backward, then per chunk its experts and their rows' and weights'
        # gradients, then the relays' (rows and weights over the NICs).
        (
            "chunked_layer_by_node",
            ["AAAAAAAAWWAWAWWAWAWWGAWWGAWAWAWW", "AAAAGAAGAAAAAA"],
            ["AAAAAWWAWAWWGAWAW", "AAGAAAA"],
        ),
        # By node per chunk (``parallel.ep_order=per_chunk``): after the same issues, chunk
        # 0's relay and experts, then chunk 1's relay, then chunk 0's relay sum (its rows
        # back over the NICs) before chunk 1's experts. Backward the mirror: chunk 1's
        # experts' backward once the sums' gradients are out, then chunk 0's relay-sum and
        # chunk 1's relay gradients, then chunk 0's experts.
        (
            "chunked_layer_by_node_per_chunk",
            ["AAAAAAAAWWAWAWWGAWWAWAWAWWGAWAWW", "AAAGAAAAAGAAAA"],
            ["AAAAAWWAWAWWGAWAW", "AAGAAAA"],
        ),
    ],
)
def test_a_chunked_exchange_travels_while_the_experts_compute(four_ranks, case, order, one_piece):
    """2 chunks (``exchange_overlap``): every stage of chunk 1 in flight while chunk 0
    computes, and backward the mirror (each gradient waited only where it is used: no wait
    of the exchange's own in backward). The output and the gradients are the one-piece
    exchange's (the weights' sums to rounding)."""
    for rank, result in four_ranks.items():
        got = result[case]
        assert got["order"] == order and got["one_piece_order"] == one_piece, (rank, got)
        assert got["output"] <= 1e-6 and got["input_grad"] <= 1e-6, (rank, got)
        assert got["weight_grads"] <= 1e-5, (rank, got)


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


def test_float8_with_experts_is_refused_on_the_cpu_and_accepted_on_hopper():
    """With ``precision.float8_experts=true``: on the CPU torchao's float8 grouped matmul does
    not run; on an H100 (9.0) the experts convert with the linears (tests/test_float8.py: the
    other refusals). Without it (the default) the experts stay bf16: nothing refused."""
    from test_config import compose

    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.distributed.float8_experts import check_experts

    run = to_run_config(
        compose(["model=moe_tiny", "precision=float8", "precision.float8_experts=true"])
    )
    with pytest.raises(ConfigError, match="runs on GPUs only"):
        check_experts(run.precision, run.model, 0)
    check_experts(run.precision, run.model, 1, capability=(9, 0))
    default = to_run_config(compose(["model=moe_tiny", "precision=float8"]))
    check_experts(default.precision, default.model, 0)
    dense = to_run_config(compose(["model=llama3_tiny", "precision=float8"]))
    check_experts(dense.precision, dense.model, 0)  # a dense model: nothing to refuse
