"""Float8 training (``precision=float8``, torchao, emulated on this CPU): which layers convert,
that float8 follows bf16 over 50 steps, that the float8 layouts agree with each other, that
compile and selective AC run with it, and that a float8 checkpoint resumes in bf16 and back.

Emulation casts and scales exactly as a GPU would and multiplies in higher precision, so these
tests prove wiring and numerics, never speed (docs/precision.md). The float8 all-gather bytes
are checked with the other layouts' in tests/test_comm.py, the refusal of a GPU without
float8 tensor cores in tests/test_gpu_devices.py.
"""

import pytest
import torch
from conftest import TINY
from distributed import run_workers
from test_config import compose
from test_parity import compose_cases

# Largest relative loss difference, float8 (tensorwise) against bf16 over the first 50 steps of
# tiny Llama under FSDP(2): measured 2.3e-4 (rowwise 2.3e-4) on 2026-11-26, under FSDP(4)
# 2.5e-4 (2.8e-4) on 2026-11-25, docs/precision.md; the bound leaves 4x headroom.
FLOAT8_VS_BF16_RTOL = 1e-3
LONG_STEPS = 50
# The bf16-vs-fp32 tolerance of tests/test_parity.py, which the float8 layouts must meet
# against each other.
LAYOUT_RTOL = 2e-2
STEPS = 4
LR = ["optim.lr=3e-3", "optim.warmup_steps=2"]


def rel_diffs(a, b, key="loss"):
    return [abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b)]


def test_output_layer_and_linears_with_unaligned_dims_stay_high_precision():
    from hsdp_runner.core.choices import DPMode
    from hsdp_runner.distributed import float8
    from hsdp_runner.models.base import model_spec

    # ffn 200 is not a multiple of 16: w1, w2, w3 stay; wq/wk/wv/wo (64 and 32 wide) convert.
    cfg = compose(["model=llama3_tiny", "precision=float8", "model.ffn_hidden_dim=200"])
    with torch.device("meta"):
        model = model_spec(cfg.model).build()
    converted = float8.convert(
        model, cfg.precision, torch.device("cpu"), DPMode.fsdp, cfg.model.vocab_size
    )
    assert converted == [f"layers.{i}.attention.w{p}" for i in (0, 1) for p in "qkvo"]
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert kinds["output"] == "Linear" and kinds["layers.0.feed_forward.w1"] == "Linear"
    # Under TP the local width counts: 64 split 8 ways is 8 columns per rank.
    split = {"wq": 0}
    assert float8.keeps_high_precision("a.wq", (64, 64), 256, 8, lambda f: split["wq"])
    assert not float8.keeps_high_precision("a.wq", (64, 64), 256, 4, lambda f: split["wq"])


def test_bf16_and_fp32_presets_train_no_float8():
    from hsdp_runner.core.choices import DPMode
    from hsdp_runner.distributed import float8

    for name in ("bf16", "bf16_pure", "fp32"):
        precision = compose([f"precision={name}"]).precision
        assert not float8.enabled(precision)
        assert not float8.gathers_float8(precision, DPMode.fsdp)


NOISE = ("Failed to load", "Could not load this library", "register_constant", "Detected no triton")


def _stderr_of(code: str) -> str:
    """stderr of a fresh Python that configures logging (as a worker does) and runs ``code``."""
    import subprocess
    import sys

    from conftest import cli_env

    setup = "import logging; logging.basicConfig(level=logging.INFO)\n"
    done = subprocess.run(
        [sys.executable, "-c", setup + code], env=cli_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_importing_torchao_through_our_float8_module_prints_one_line_and_none_of_its_noise():
    import torch

    if torch.version.cuda or torch.version.hip:
        pytest.skip("the kernel libraries this checks for load on a CUDA build")
    # torchao imported directly fills the console with its import-time lines ...
    bare = _stderr_of("import torchao.float8")
    assert all(noise in bare for noise in NOISE), bare
    # ... imported through hsdp_runner none of them, and one line, once, that says why.
    ours = _stderr_of(
        "from hsdp_runner.distributed import float8\n"
        "float8.torchao_float8(); float8.torchao_float8()"
    )
    assert not [noise for noise in NOISE if noise in ours], ours
    assert ours.count("are not available in this CPU-only torch build") == 1, ours
    assert "it is emulated on the CPU" in ours


def _train(configs):
    """Train each ``{name: typed config}`` case on these ranks; return {name: step
    records}, and under ``compiled_frames`` the (function, file name) of every frame Dynamo
    compiled in this rank."""
    from pathlib import Path

    from test_parity import _train_cases
    from torch._dynamo.utils import get_compilation_metrics

    out = {name: records for name, (records, _) in _train_cases(configs).items()}
    frames = get_compilation_metrics()
    out["compiled_frames"] = {(m.co_name, Path(m.co_filename).name) for m in frames if m.co_name}
    return out


def _leg_configs(root):
    """The typed configs of ``_checkpoint_legs`` (converted here, not on every rank): float8 FSDP(4) 4 steps saving at 2 (HF
    export at the end), bf16 from step 2 saving at 3, float8 again from step 3."""
    legs = (
        ("float8", "float8", ["checkpoint.interval=2", "checkpoint.export_at_end=true"]),
        (
            "bf16",
            "bf16",
            ["checkpoint.interval=3", f"checkpoint.load_path={root}/float8/checkpoints/step-2"],
        ),
        ("back", "float8", [f"checkpoint.load_path={root}/bf16/checkpoints/step-3"]),
    )
    from hsdp_runner.config.compose import to_run_config

    return {
        name: to_run_config(
            compose(
                [*TINY, "parallel=fsdp", "trainer.steps=4", f"precision={precision}"]
                + ["checkpoint.enable=true", "checkpoint.export_dtype=float32", *extra]
            )
        )
        for name, precision, extra in legs
    }


def _checkpoint_legs(configs, root):
    """Run the legs of ``_leg_configs`` in turn through the job's own checkpointer; returns
    ({leg: records}, root)."""

    from hsdp_runner.checkpoint import start as checkpoint_start
    from hsdp_runner.runtime.rank_training import make_checkpointer, rank_trainer

    out = {}
    for name, run in configs.items():
        trainer, _ = rank_trainer(run)
        ckpt = make_checkpointer(run, root / name, trainer)
        start = checkpoint_start.agree_on_start(run.checkpoint, run.model, root / name)
        out[name] = trainer.fit(ckpt.restore(start), ckpt.after_step)
        ckpt.export_at_end()
    return out, root


def _train_and_resume(configs, legs, root):
    return {**_train(configs), "checkpoint_legs": _checkpoint_legs(legs, root)}


@pytest.fixture(scope="module")
def four_rank_float8(tmp_path_factory):
    """One set of four workers: float8 under FSDP(4), HSDP(2x2) and FSDP(2) x TP(2), then the
    checkpoint legs (``_checkpoint_legs``). Then two workers: float8 FSDP(2) with compile and
    selective AC, and bf16 and float8 FSDP(2) for 50 steps."""
    short = ["precision=float8", f"trainer.steps={STEPS}", "metrics.memory_steps=0", *LR]
    long = [f"trainer.steps={LONG_STEPS}", "metrics.memory_steps=0", "metrics.comm_step=null"]
    root = tmp_path_factory.mktemp("float8_checkpoints")
    cases = {
        "fsdp": ["parallel=fsdp", *short],
        "hsdp": ["parallel=hsdp", *short],
        "fsdp_tp": ["parallel=fsdp_tp", *short],
    }
    runs = run_workers(_train_and_resume, 4, compose_cases(cases), _leg_configs(root), root)[0]
    # A tiny model's step costs about the same on each rank whatever its share of the batch:
    # these run on two, the same global batch. The compiled case goes through Dynamo and
    # AOTAutograd (the float8 and FSDP tensor subclasses, selective AC's policy in the
    # partitioner: all of the runner's compile path) but not inductor's code generation,
    # whose C++ compiles cost 35 of this case's 40 CPU-s here; inductor runs in the GPU
    # check (benchmarks/float8_gpu_check.py, docs/testing.md).
    fsdp2 = ["parallel=fsdp", "parallel.dp_shard=2"]
    two_rank_cases = {
        "fsdp_compiled_selective": [
            *fsdp2,
            *short,
            "parallel.compile=true",
            "parallel.compile_backend=aot_eager",
            "parallel.ac=selective",
            "metrics.comm_step=1",  # the default, which the frames check is about
        ],
        "bf16_long": [*fsdp2, "precision=bf16", *long],
        "float8_long": [*fsdp2, "precision=float8", *long],
    }
    return {**runs, **run_workers(_train, 2, compose_cases(two_rank_cases))[0]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp", "fsdp_compiled_selective"])
def test_float8_layouts_match_fsdp_within_the_bf16_parity_tolerance(four_rank_float8, layout):
    base = four_rank_float8["fsdp"]
    other = four_rank_float8[layout]
    assert len(other) == STEPS and other[-1]["loss"] < other[0]["loss"]
    assert max(rel_diffs(other, base)) <= LAYOUT_RTOL, layout
    assert max(rel_diffs(other, base, "grad_norm")) <= LAYOUT_RTOL, layout


@pytest.mark.multiprocess
def test_compiled_blocks_run_compiled_after_the_step_whose_communication_is_counted(
    four_rank_float8,
):
    """The compiled case counts step 1's collectives (``metrics.comm_step=1``, the default)
    under a dispatch mode. Dynamo leaves a frame first called under one uncompiled for good;
    the counted step runs eagerly instead, so the blocks' forward compiles in step 2, and no
    float8 dispatch runs as a compiled frame of its own (what an eager block's float8 matmuls
    did after a counted step: half the speed on an H100, docs/precision.md). The compiled
    block is the selective-AC wrapper, whose forward Dynamo compiles with the block inlined."""
    frames = four_rank_float8["compiled_frames"]
    assert ("forward", "checkpoint_wrapper.py") in frames, frames
    assert not any(name == "__torch_dispatch__" for name, _ in frames), frames


@pytest.mark.multiprocess
def test_float8_follows_bf16_over_50_steps(four_rank_float8):
    bf16, f8 = four_rank_float8["bf16_long"], four_rank_float8["float8_long"]
    assert len(f8) == LONG_STEPS and f8[-1]["loss"] < f8[0]["loss"] - 0.5
    worst = max(rel_diffs(f8, bf16))
    assert 0 < worst <= FLOAT8_VS_BF16_RTOL  # > 0: the matmuls really went through float8


@pytest.mark.multiprocess
def test_float8_checkpoint_resumes_in_bf16_and_back_and_exports_the_same(four_rank_float8):
    """float8 FSDP(4) saves at step 2 and exports at 4; bf16 resumes from step 2 and saves at 3;
    float8 resumes from that. Each first loss is the float8 run's at that step within the
    float8-vs-bf16 tolerance; the HF export equals the checkpoint's weights (plain tensors:
    the checkpoint loads without torchao's classes)."""
    from omegaconf import OmegaConf

    from hsdp_runner.checkpoint import hf
    from hsdp_runner.checkpoint.checkpointer import expected_shapes
    from hsdp_runner.export import load_full_weights

    legs, root = four_rank_float8["checkpoint_legs"]
    loss = {r["step"]: r["loss"] for r in legs["float8"]}
    for name, first in (("bf16", 3), ("back", 4)):
        records = legs[name]
        assert records[0]["step"] == first
        assert records[0]["loss"] == pytest.approx(loss[first], rel=FLOAT8_VS_BF16_RTOL), name
    weights, manifest = load_full_weights(root / "float8" / "checkpoints" / "step-4")
    model_cfg = OmegaConf.create(manifest["model"])
    exported = hf.read_folder(root / "float8" / "hf", model_cfg, expected_shapes(model_cfg))
    assert set(exported) == set(weights)
    for name, tensor in weights.items():
        assert type(tensor) is torch.Tensor and tensor.dtype == torch.float32, name
        assert torch.equal(tensor, exported[name]), name


# --- Routed experts (float8 grouped matmuls: GPU only; conversion and wiring checked here) ---


def _plain_grouped_mm(calls):
    """A stand-in for torchao's float8 grouped matmul (its Triton kernels need a GPU) that
    records each call and multiplies in the inputs' dtype, as ``torch._grouped_mm`` does."""

    def run(A, B_t, config, offs=None, bias=None):
        calls.append((tuple(A.shape), tuple(B_t.shape), offs.tolist()))
        return torch._grouped_mm(A, B_t, offs=offs)

    return run


def test_routed_experts_convert_with_the_linears_router_gate_and_output_stay_high():
    from hsdp_runner.core.choices import DPMode
    from hsdp_runner.distributed import float8, float8_experts
    from hsdp_runner.models.base import model_spec

    def convert(model, precision, vocab_size):  # what a job's build calls
        names = float8.convert(model, precision, torch.device("meta"), DPMode.fsdp, vocab_size)
        return names + float8_experts.convert(model, precision, torch.device("meta"))

    # Without precision.float8_experts (the presets) the experts stay in param_dtype.
    default = compose(["model=moe_tiny", "precision=float8"])
    with torch.device("meta"):
        model = model_spec(default.model).build()
    names = convert(model, default.precision, 256)
    assert names and not [n for n in names if ".experts." in n]
    cfg = compose(["model=moe_tiny", "precision=float8", "precision.float8_experts=true"])
    with torch.device("meta"):
        model = model_spec(cfg.model).build()
    converted = convert(model, cfg.precision, cfg.model.vocab_size)
    experts = [f"layers.{i}.moe.experts.w{p}" for i in (1, 2) for p in "132"]
    assert [n for n in converted if ".experts." in n] == experts
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert kinds["layers.1.moe.router.gate"] == "Linear" and kinds["output"] == "Linear"
    assert kinds["layers.1.moe.shared_experts.w1"] == "Float8Linear"
    assert kinds["layers.0.feed_forward.w1"] == "Float8Linear"
    params = dict(model.named_parameters())
    wrapped = {n for n, p in params.items() if type(p.data).__name__.startswith("Float8Training")}
    assert wrapped == set(experts)  # exactly the experts' stacked weights
    assert model.layers["1"].moe.experts.group_rows == 16
    # The per-expert loop is not converted (check_experts refuses float8 with it).
    loop = compose(
        [
            "model=moe_tiny",
            "precision=float8",
            "precision.float8_experts=true",
            "model.grouped_mm=false",
        ]
    )
    with torch.device("meta"):
        model = model_spec(loop.model).build()
    names = convert(model, loop.precision, 256)
    assert not [n for n in names if ".experts." in n]


def test_float8_experts_run_their_grouped_matmuls_through_torchao_with_aligned_groups(
    monkeypatch,
):
    """The wrapper catches the experts' ``torch._grouped_mm`` calls (here multiplied in fp32
    by a stand-in: the float8 kernels need a GPU), each group padded to 16 rows; outputs and
    gradients equal the unconverted experts'."""
    import copy

    import torchao.prototype.moe_training.tensor as ao_tensor

    from hsdp_runner.distributed import float8_experts
    from hsdp_runner.models.moe_routing import GroupedExperts

    calls = []
    monkeypatch.setattr(ao_tensor, "_quantize_then_scaled_grouped_mm", _plain_grouped_mm(calls))
    torch.manual_seed(0)
    ref = torch.nn.Module()
    ref.experts = GroupedExperts(32, 48, 4, grouped_mm=True)
    for w in ref.experts.parameters():
        torch.nn.init.normal_(w, std=0.1)
    model = copy.deepcopy(ref)
    assert float8_experts.convert_experts(model, torch.device("cuda")) == [
        "experts.w1",
        "experts.w3",
        "experts.w2",
    ]
    counts = torch.tensor([3, 0, 17, 5])
    x = torch.randn(25, 32)
    grad = torch.randn(25, 32)
    weight = torch.rand(25)
    results = []
    for m in (ref, model):
        xi, wi = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        m.experts(xi, counts, wi).backward(grad)
        results.append([xi.grad, wi.grad, *(p.grad for p in m.experts.parameters())])
    assert len(calls) == 3  # the forward's three (backward: the stand-in's autograd)
    assert calls[0][2] == [16, 16, 48, 96]  # 3 -> 16, 0, 17 -> 32, 5 -> 16 + the spare rows
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, kwargs, message",
    [
        ([], {"gpus": 0}, "torchao's float8 grouped matmul runs on GPUs only"),
        (["model.grouped_mm=false"], {}, "set model.grouped_mm=true"),
        (["model.expert_ffn_dim=40"], {}, "model.expert_ffn_dim=40 is not a multiple of 16"),
        (["model.dim=72", "model.n_heads=4"], {}, "model.dim=72 is not a multiple of 16"),
        ([], {"compile": True}, "set parallel.compile=false"),
        ([], {"capability": (8, 9)}, "compute capability 9.0, 10.0 only (H100, H200, B200)"),
        ([], {"capability": (12, 0)}, "this GPU is 12.0"),
    ],
)
def test_float8_experts_refusals_name_the_key_and_the_fix(overrides, kwargs, message):
    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.core.errors import ConfigError
    from hsdp_runner.distributed.float8_experts import check_experts

    run = to_run_config(
        compose(["model=moe_tiny", "precision=float8", "precision.float8_experts=true", *overrides])
    )
    kwargs = {"gpus": 1, "capability": (9, 0), **kwargs}
    with pytest.raises(ConfigError, match="with a model with experts") as err:
        check_experts(run.precision, run.model, **kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("preset", ["moe_tiny", "qwen3_30b_a3b"])
@pytest.mark.parametrize("recipe", ["float8", "float8_rowwise"])
def test_float8_experts_pass_on_hopper_and_blackwell(preset, recipe):
    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.distributed import float8_experts

    default = to_run_config(compose([f"model={preset}", f"precision={recipe}"]))
    assert not float8_experts.converts_experts(default.precision, default.model)
    float8_experts.check_experts(
        default.precision, default.model, 0
    )  # experts bf16: runs on CPU too
    run = to_run_config(
        compose([f"model={preset}", f"precision={recipe}", "precision.float8_experts=true"])
    )
    assert float8_experts.converts_experts(run.precision, run.model)
    for capability in float8_experts.GROUPED_CAPABILITIES:
        float8_experts.check_experts(run.precision, run.model, 1, False, capability)
    float8_experts.check_experts(run.precision, run.model, 1)  # the planner: no capability to check
    bf16 = to_run_config(compose([f"model={preset}", "precision=bf16"]))
    float8_experts.check_experts(bf16.precision, bf16.model, 0, True)  # no float8: nothing refused
    assert not float8_experts.converts_experts(bf16.precision, bf16.model)


def test_float8_experts_stay_wrapped_under_expert_parallel_and_fsdp_and_save_plain(monkeypatch):
    """On a fake 4-rank world (one process): the wrapper survives expert parallel's
    ``distribute_tensor`` and FSDP2's sharding and all-gather (its hooks gather in
    param_dtype), the sharded experts' forward and backward reach torchao's grouped matmul,
    and ``plain_state`` saves the wrapped tensors."""
    import torch.distributed as dist
    import torchao.prototype.moe_training.tensor as ao_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hsdp_runner.distributed import float8, float8_experts
    from hsdp_runner.models.moe_routing import GroupedExperts

    calls = []
    monkeypatch.setattr(ao_tensor, "_quantize_then_scaled_grouped_mm", _plain_grouped_mm(calls))
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        with torch.device("meta"):
            experts = GroupedExperts(32, 48, 4, grouped_mm=True)
        float8_experts.convert_experts(experts, torch.device("meta"))
        for name, p in list(experts.named_parameters(recurse=False)):
            shard = distribute_tensor(p.data, mesh["ep"], [Shard(0)], src_data_rank=None)
            setattr(experts, name, torch.nn.Parameter(shard))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(experts, mesh=mesh["efsdp"], mp_policy=policy)
        experts.to_empty(device="cpu")
        for p in experts.parameters():
            assert isinstance(p, DTensor)
            assert type(p._local_tensor).__name__ == "Float8TrainingWeightWrapperTensor"
        x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
        experts(x, torch.tensor([4, 2]), torch.rand(6)).sum().backward()
        # 2 local experts of (48, 32); 4 + 2 rows padded to [16, 32 + the spare 16]
        assert [c[1:] for c in calls[:1]] == [((2, 32, 48), [16, 48])] and len(calls) == 3
        assert all(p.grad is not None for p in experts.parameters())
        state = float8.plain_state(experts.state_dict())
        assert all(type(t._local_tensor) is torch.Tensor for t in state.values())
    finally:
        dist.destroy_process_group()
