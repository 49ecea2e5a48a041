"""Correctness cases from the FSDP/HSDP design discussions (../shared/seeds), in-process."""

import pytest
import torch
from distributed import own_groups, run_workers
from test_config import compose
from torch import nn

pytestmark = pytest.mark.multiprocess


class GradientProbe(nn.Module):
    """loss = sum(weight * x): the local gradient of every weight entry is exactly x."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 4))

    def forward(self, x):
        return (self.weight * x).sum()


def _reduced_gradients(precision):
    import torch.distributed as dist

    from hsdp_runner.config.schema import ParallelConfig
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.parallelize import apply_data_parallel

    out = {}
    for name, degrees in {
        "ddp": (4, 1),
        "ddp_fully_shard": (4, 1),
        "fsdp": (1, 4),
        "hsdp": (2, 2),
    }.items():
        parallel = ParallelConfig(
            dp_replicate=degrees[0], dp_shard=degrees[1], sequence_parallel=False
        )
        dims = ParallelDims.from_config(parallel, None, dist.get_world_size())
        world = dims.build_mesh("cpu")
        model = GradientProbe()
        impl = "fully_shard" if name == "ddp_fully_shard" else "replicate"
        apply_data_parallel(model, dims, world, precision, True, impl)
        x = float(world.local_rank_in("dp") + 1)  # dp ranks see 1, 2, 3, 4
        model(torch.tensor(x)).backward()
        out[name] = model.weight.grad.full_tensor()
    return out


def _adamw_on_shards_against_torch() -> dict:
    """Three AdamW steps (weight decay on) of the runner's ``ShardLocalAdamW`` and of torch's
    fused AdamW over the same DTensors on a 2 x 2 mesh: FSDP x TP's strided shards, a 2-D
    shard, and a replicated weight with a TP ``Partial`` gradient (summed over tp first). Returns {name: (parameters equal bit for bit, moments equal and DTensors
    of the parameter's placements)}."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from hsdp_runner.train.optimizer import ShardLocalAdamW

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    cases = {
        "strided": ([_StridedShard(0, split_factor=2), Shard(0)], None),
        "2d_shard": ([Shard(0), Shard(1)], None),
        "partial_grad": ([Replicate(), Replicate()], [Replicate(), Partial()]),
    }

    def tensors():
        params, grads = {}, {}
        for name, (placements, grad_placements) in cases.items():
            local = torch.randn(4, 6, generator=torch.Generator().manual_seed(len(name)))
            params[name] = nn.Parameter(DTensor.from_local(local, mesh, placements))
            grads[name] = [
                DTensor.from_local(
                    torch.randn(4, 6, generator=gen), mesh, grad_placements or placements
                )
                for _ in range(3)
            ]
        return params, grads

    results = []
    for optimizer_class in (torch.optim.AdamW, ShardLocalAdamW):
        gen.manual_seed(rank)
        params, grads = tensors()
        optimizer = optimizer_class(params.values(), lr=1e-2, weight_decay=0.1, fused=True)
        for step in range(3):
            for name, param in params.items():
                param.grad = grads[name][step]
            optimizer.step()
        results.append((params, optimizer.state))
    (torch_params, torch_state), (ours, our_state) = results

    def local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    out = {}
    for name, param in ours.items():
        ref = torch_params[name]
        moments = [(our_state[param][k], torch_state[ref][k]) for k in ("exp_avg", "exp_avg_sq")]
        out[name] = (
            torch.equal(local(param), local(ref)),
            all(
                torch.equal(local(a), local(b))
                and type(a) is type(b)
                and getattr(a, "placements", None) == getattr(param, "placements", None)
                for a, b in moments
            ),
        )
    return out


def _reference_fused_backward(grad, x, rstd, weight, needs):
    """What torch's fused RMSNorm backward computes (fp32 inside; the weight's gradient from
    the unrounded normalised value), in torch ops: this CPU build has no kernel for it."""
    normed = x.float() * rstd
    grad_x = grad_w = None
    if needs[0]:
        grad_normed = grad.float() * weight.float()
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        grad_x = ((grad_normed - normed * dot) * rstd).to(x.dtype)
    if needs[1]:
        grad_w = (grad.float() * normed).sum(tuple(range(x.dim() - 1))).to(weight.dtype)
    return grad_x, grad_w


def _fused_norm_on_sequence_shards() -> dict:
    """RMSNorm of a sequence-sharded DTensor (4 ranks, ``Shard(1)``, as sequence parallel
    hands the norms) with a replicated weight, through the fused-kernel path (its kernels
    run on each rank's rows; the backward's stood in by ``_reference_fused_backward``) and op
    by op. Returns {what: equal bit for bit} for the output, both gradients (the weight's
    summed over the ranks), and whether the fused path ran."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hsdp_runner.models import norm_rope

    mesh = init_device_mesh("cpu", (4,))
    gen = torch.Generator().manual_seed(0)
    full_x, full_grad = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    full_weight = 1 + 0.5 * torch.randn(16, generator=gen)
    calls, results = [], []
    fused_backward = norm_rope.fused_rms_norm_backward
    for fused in (True, False):
        x = DTensor.from_local(full_x.chunk(4, dim=1)[mesh.get_local_rank()], mesh, [Shard(1)])
        x.requires_grad_()
        weight = nn.Parameter(DTensor.from_local(full_weight, mesh, [Replicate()]))
        grad = DTensor.from_local(
            full_grad.chunk(4, dim=1)[mesh.get_local_rank()], mesh, [Shard(1)]
        )
        if fused:
            norm_rope.FUSED_NORM_DEVICES.add("cpu")
            norm_rope.fused_rms_norm_backward = lambda *a: (
                calls.append(1) or _reference_fused_backward(*a)
            )
        try:
            out = norm_rope.RMSNormFunction.apply(x, weight, 1e-6)
            out.backward(grad)
        finally:
            norm_rope.FUSED_NORM_DEVICES.discard("cpu")
            norm_rope.fused_rms_norm_backward = fused_backward
        results.append([out.full_tensor(), x.grad.full_tensor(), weight.grad.full_tensor()])
    names = ("out", "grad_x", "grad_weight")
    return {
        **{n: torch.equal(a, b) for n, a, b in zip(names, *results)},
        "fused_ran": bool(calls),
    }


def _block_input_dtypes() -> dict:
    """{layout: (dtype of h, of cos, of sin)} reaching block 0 of llama3_tiny under bf16 mixed
    precision on 4 ranks, FSDP and FSDP-based DDP: the hidden state in the compute dtype, the
    RoPE tables left in fp32 (FSDP would cast every float input of a wrapped block)."""
    import torch.distributed as dist

    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.config.schema import ParallelConfig
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.parallelize import apply_data_parallel
    from hsdp_runner.models.base import model_spec

    run = to_run_config(compose(["model=llama3_tiny", "precision=bf16"]))
    out = {}
    for name, degrees in {"ddp": (4, 1), "fsdp": (1, 4)}.items():
        parallel = ParallelConfig(dp_replicate=degrees[0], dp_shard=degrees[1])
        dims = ParallelDims.from_config(parallel, run.model, dist.get_world_size())
        model = model_spec(run.model).build()
        model.init_weights(0)
        apply_data_parallel(model, dims, dims.build_mesh("cpu"), run.precision, True)
        seen = []
        model.blocks()["0"].register_forward_pre_hook(
            lambda module, args, seen=seen: seen.append(tuple(a.dtype for a in args))
        )
        with torch.no_grad():
            model(torch.zeros((1, 8), dtype=torch.long))
        out[name] = seen[0]
    return out


def _four_rank_cases(precision, eval_cases):
    """The gradient probe (the default ``precision``), the optimizer on local shards, the norm's
    fused path on sequence shards, then the eval/frozen cases: one set of four workers serves
    all four."""
    return {
        "grads": _reduced_gradients(precision),
        "adamw": _adamw_on_shards_against_torch(),
        "norm": _fused_norm_on_sequence_shards(),
        "block_inputs": _block_input_dtypes(),
        "eval": _train_eval_frozen(eval_cases),
    }


@pytest.fixture(scope="module")
def four_ranks():
    """Rank 0's results of ``_four_rank_cases`` for fsdp, hsdp and fsdp_tp, each with
    ``reshard_after_forward`` on and off."""
    cases = [
        (layout, reshard) for layout in ("fsdp", "hsdp", "fsdp_tp") for reshard in (True, False)
    ]
    return run_workers(_four_rank_cases, 4, compose([]).precision, _eval_configs(cases))[0]


def test_gradient_reduction_divides_once_by_the_dp_size(four_ranks):
    grads = four_ranks["grads"]
    for name, grad in grads.items():
        # mean over dp ranks of (1, 2, 3, 4) = 2.5; a missing division gives 10, a double one less.
        assert torch.equal(grad, torch.full((8, 4), 2.5)), (name, grad.flatten()[:4])


def test_blocks_get_the_hidden_state_in_bf16_and_the_rope_tables_in_fp32(four_ranks):
    expected = (torch.bfloat16, torch.float32, torch.float32)
    assert four_ranks["block_inputs"] == {"ddp": expected, "fsdp": expected}


def test_fused_norm_kernels_on_sequence_shards_equal_the_op_by_op_norm(four_ranks):
    assert four_ranks["norm"] == {
        "out": True,
        "grad_x": True,
        "grad_weight": True,
        "fused_ran": True,
    }


def test_adamw_on_local_shards_equals_torchs_on_dtensors_bit_for_bit(four_ranks):
    assert four_ranks["adamw"] == {
        name: (True, True) for name in ("strided", "2d_shard", "partial_grad")
    }


# Frozen: the embedding, and a norm, which TP's sequence-parallel style replaces with a new
# parameter (it must stay frozen through TP).
FROZEN = ("tok_embeddings.weight", "layers.0.attention_norm.weight")


def _eval_configs(cases):
    """[((layout, reshard_after_forward), typed config)] of the eval/frozen cases: 3 steps of
    tiny Llama with the embedding and a norm frozen; composed and converted here, not on every rank."""
    from hsdp_runner.config.compose import to_run_config

    return [
        (
            (layout, reshard),
            to_run_config(
                compose(
                    [
                        f"parallel={layout}",
                        "model=llama3_tiny",
                        "trainer.steps=3",
                        "logger=none",
                        "metrics.comm_step=null",  # no communication count: nothing reads it
                        f"parallel.reshard_after_forward={str(reshard).lower()}",
                        "trainer.freeze=['tok_embeddings.*','layers.0.attention_norm.*']",
                    ]
                )
            ),
        )
        for layout, reshard in cases
    ]


def _train_eval_frozen(cases):
    """Train, evaluate and check the frozen embedding for each of ``_eval_configs``, each
    case's groups ended before the next (``own_groups``)."""
    results = {}
    for (layout, reshard), cfg in cases:
        with own_groups():
            results[f"{layout}/reshard={reshard}"] = _train_eval_frozen_case(cfg)
    return results


def _train_eval_frozen_case(cfg) -> dict:
    """One case of ``_train_eval_frozen``: its results."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from hsdp_runner.models.llama import Llama
    from hsdp_runner.runtime.rank_training import rank_trainer
    from hsdp_runner.train.data import EVAL_STEP_OFFSET, TokenBatches

    trainer, dims = rank_trainer(cfg)
    (model,) = trainer.parts

    def full_weights(model=model):
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()
        }

    before = full_weights()
    trainer.fit()
    eval_loss = trainer.evaluate(2)
    after = full_weights()
    single_eval = None
    if dist.get_rank() == 0:
        plain = Llama(cfg.model)
        plain.load_state_dict(after, strict=False)
        batches = TokenBatches(
            cfg.data,
            cfg.model.vocab_size,
            cfg.model.seq_len,
            cfg.trainer.global_batch_size,
            0,
            1,
            cfg.trainer.seed,
        )
        with torch.no_grad():
            losses = [
                F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
                for x, y in (batches.local_batch(EVAL_STEP_OFFSET + i) for i in range(2))
            ]
        single_eval = torch.stack(losses).mean().item()
    return {
        "frozen_identical": all(torch.equal(before[n], after[n]) for n in FROZEN),
        "frozen_requires_grad": any(
            dict(model.named_parameters())[n].requires_grad for n in FROZEN
        ),
        "trained_changed": not torch.equal(before["output.weight"], after["output.weight"]),
        "eval_loss": eval_loss,
        "single_eval": single_eval,
    }


def _check_eval_and_frozen(results):
    for case, r in results.items():
        assert r["frozen_identical"] and not r["frozen_requires_grad"], case
        assert r["trained_changed"], case
        assert r["eval_loss"] == pytest.approx(r["single_eval"], rel=1e-6), case


def test_eval_after_training_and_frozen_params_on_four_ranks(four_ranks):
    _check_eval_and_frozen(four_ranks["eval"])


def test_eval_after_training_and_frozen_params_on_two_ranks():
    cases = _eval_configs([("ddp", True), ("tp", True)])
    _check_eval_and_frozen(run_workers(_train_eval_frozen, 2, cases)[0])


def _two_models_state_dicts(configs):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.distributed.parallelize import build_model

    models = {}
    for name, cfg in configs.items():
        dims = ParallelDims.from_config(cfg.parallel, cfg.model, dist.get_world_size())
        models[name] = build_model(
            cfg.model,
            dims,
            dims.build_mesh("cpu"),
            cfg.parallel,
            cfg.precision,
            torch.device("cpu"),
            seed=len(name),
        )
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    saved = {n: get_model_state_dict(m, options=full) for n, m in models.items()}
    # Sharded (DTensor) state dicts share storage with the parameters: clone before zeroing.
    sharded = {
        n: {k: v.clone() for k, v in get_model_state_dict(m).items()} for n, m in models.items()
    }
    for model in models.values():
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    # Loading one model's state dict must not disturb the other's calls. (Loading a *full*
    # state dict into strided-sharded FSDP+TP parameters deadlocks in torch 2.13's
    # set_model_state_dict, rank 0 scattering while the others redistribute; DCP and this
    # runner load sharded state dicts.)
    ok = {}
    for name, model in models.items():
        set_model_state_dict(model, sharded[name])
        back = get_model_state_dict(model, options=full)
        ok[name] = all(torch.equal(back[k], v) for k, v in saved[name].items())
    return ok


TWO_MODELS = {
    "hsdp_tp": ["parallel=hsdp_tp", "model=llama3_tiny"],
    "fsdp8": ["parallel=fsdp", "parallel.dp_shard=8", "model=llama3_tiny"],
}


def test_hsdp_tp_and_fsdp_models_in_one_process_keep_separate_state_dicts(eight_ranks):
    """Runs in conftest's ``eight_ranks`` workers (``_two_models_state_dicts`` of
    ``TWO_MODELS``)."""
    assert eight_ranks[0]["state_dicts"] == {"hsdp_tp": True, "fsdp8": True}
