"""The mesh and parameter placements are what each layout says, and buffers agree on all ranks."""

import pytest
import torch
from distributed import run_workers
from test_config import compose

pytestmark = pytest.mark.multiprocess


def _build(cfg):
    """Build the model of composed config ``cfg`` on these ranks; return (dims, world mesh,
    model)."""
    import torch.distributed as dist

    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.parallelize import build_model

    dims = ParallelDims.from_config(cfg.parallel, cfg.model, dist.get_world_size())
    world = dims.build_mesh("cpu")
    model = build_model(
        cfg.model, dims, world, cfg.parallel, cfg.precision, torch.device("cpu"), cfg.trainer.seed
    )
    return dims, world, model


def _placements(cfg):
    from torch.distributed.tensor import DTensor

    dims, world, model = _build(cfg)
    params = {}
    for name, p in model.named_parameters():
        clean = name.replace("_checkpoint_wrapped_module.", "")
        params[clean] = (
            (
                tuple(repr(x) for x in p.placements),
                p.device_mesh.mesh_dim_names,
                p.full_tensor().sum().item(),
            )
            if isinstance(p, DTensor)
            else (None, None, p.sum().item())
        )
    return {
        "mesh": (world.root.mesh_dim_names, tuple(world.root.shape)),
        "dp_size": world["dp"].size(),
        "dp_rank": world.local_rank_in("dp"),
        "params": params,
        "rope": model.rope_cos.sum().item() if hasattr(model, "rope_cos") else None,
    }


TINY = ["model=llama3_tiny"]
# The eight-rank cases: {name: overrides}; "buffers" is built with a per-rank buffer added.
EIGHT_RANK_LAYOUTS = {
    "hsdp_tp": ["parallel=hsdp_tp", *TINY],
    "fsdp": ["parallel=fsdp", "parallel.dp_shard=8", *TINY],
    "hsdp": ["parallel=hsdp", "parallel.dp_replicate=2", "parallel.dp_shard=4", *TINY],
    "ddp": ["parallel=ddp", "parallel.dp_replicate=8", *TINY],
    "gpt2_hsdp_tp": ["parallel=hsdp_tp", "model=gpt2_tiny"],
    "buffers": ["parallel=hsdp", "parallel.dp_shard=4", *TINY],
}


def _eight_rank_layouts(configs):
    """hsdp_tp, fsdp (8), hsdp (2x4) and ddp (8) placements, then hsdp buffers, of the composed
    ``EIGHT_RANK_LAYOUTS``: conftest's ``eight_ranks`` workers serve every test below but the
    single-process reference."""
    out = {name: _placements(cfg) for name, cfg in configs.items() if name != "buffers"}
    return {**out, "buffers": _buffers_after_build(configs["buffers"])}


def test_hsdp_tp_parameters_are_replicate_strided_shard_and_shard_on_3d_mesh(eight_ranks):
    results = {rank: layouts["hsdp_tp"] for rank, layouts in eight_ranks.items()}
    r0 = results[0]
    assert r0["mesh"] == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (1, 2, 2, 1, 2))
    assert r0["dp_size"] == 4
    assert sorted(r["dp_rank"] for r in results.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    params = r0["params"]
    names = ("dp_replicate", "dp_shard", "tp")
    colwise = ("Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    assert params["layers.0.attention.wq.weight"][:2] == (colwise, names)
    assert params["layers.0.feed_forward.w1.weight"][0] == colwise
    assert params["layers.0.attention.wo.weight"][0] == (
        "Replicate()",
        "Shard(dim=0)",
        "Shard(dim=1)",
    )
    assert params["layers.0.attention_norm.weight"][0] == (
        "Replicate()",
        "Shard(dim=0)",
        "Replicate()",
    )


def test_gpt2_biases_follow_their_layers_and_positions_split_by_sequence(eight_ranks):
    """A column-parallel layer's bias is sharded with its weight, a row-parallel layer's bias
    stays whole on the TP ranks (added once, after the reduction), and with sequence parallel
    the position table is split by position like the residual stream."""
    params = eight_ranks[0]["gpt2_hsdp_tp"]["params"]
    colwise = ("Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    whole_on_tp = ("Replicate()", "Shard(dim=0)", "Replicate()")
    for name in ("attn.q_proj", "attn.v_proj", "mlp.c_fc"):
        assert params[f"h.0.{name}.weight"][0] == params[f"h.0.{name}.bias"][0] == colwise, name
    for name in ("attn.c_proj", "mlp.c_proj"):
        assert params[f"h.1.{name}.weight"][0] == ("Replicate()", "Shard(dim=0)", "Shard(dim=1)")
        assert params[f"h.1.{name}.bias"][0] == whole_on_tp, name
    assert params["h.0.ln_1.weight"][0] == params["h.0.ln_2.bias"][0] == whole_on_tp
    assert params["wpe.weight"][0] == colwise


def test_fsdp_hsdp_and_ddp_placements_and_identical_initial_weights(eight_ranks):
    single = run_workers(_placements, 1, compose(["parallel=single", *TINY]))[0]
    fsdp, hsdp, ddp = (eight_ranks[0][layout] for layout in ("fsdp", "hsdp", "ddp"))
    key = "layers.1.feed_forward.w2.weight"
    assert single["params"][key][0] is None
    assert fsdp["params"][key][:2] == (("Shard(dim=0)",), ("dp_shard",))
    assert hsdp["params"][key][:2] == (
        ("Replicate()", "Shard(dim=0)"),
        ("dp_replicate", "dp_shard"),
    )
    assert ddp["params"][key][:2] == (("Replicate()",), ("dp_replicate",))
    for layout in (fsdp, hsdp, ddp):
        for name, (_, _, total) in single["params"].items():
            assert layout["params"][name][2] == pytest.approx(total, rel=1e-6, abs=1e-6), name


def _buffers_after_build(cfg):
    import torch.distributed as dist

    # A buffer that differs per rank at creation must agree after the model is built.
    torch.manual_seed(dist.get_rank())
    from hsdp_runner.distributed.parallelize import sync_buffers

    dims, world, model = _build(cfg)
    model.register_buffer("noise", torch.randn(4))
    before = model.noise.clone()
    sync_buffers(model)
    return before.tolist(), model.noise.tolist(), model.rope_sin.sum().item()


def test_non_dtensor_buffers_are_identical_on_every_rank(eight_ranks):
    results = {rank: layouts["buffers"] for rank, layouts in eight_ranks.items()}
    befores = [r[0] for r in results.values()]
    afters = [r[1] for r in results.values()]
    assert len({tuple(b) for b in befores}) > 1
    assert all(a == afters[0] for a in afters) and afters[0] == befores[0]
