"""Every config value a user can get wrong: exit code 2, one message naming key, value and fix,
before any worker starts. Adding a case is one line in BAD_INPUTS."""

import pytest
from conftest import TINY, run_cli
from hydra.core.global_hydra import GlobalHydra

from hsdp_runner.runtime import app, prelaunch

# A pipeline job under the zero-bubble schedule, 2 stages per rank on 2 ranks.
ZERO_BUBBLE = [
    "parallel=pp",
    "model.n_layers=4",
    "parallel.pp_schedule=interleaved_zb",
    "parallel.pp_stages_per_rank=2",
]
# (overrides, words the message must contain, GPUs the machine pretends to have or None)
BAD_INPUTS = [
    (["parallel.tpp=2"], "tpp", None),  # unknown key
    (["parallel.tp=two"], "two", None),  # wrong type
    (["trainer.steps=1.5"], "trainer.steps", None),  # wrong type
    (["parallel.dp_shard=0"], "parallel.dp_shard=0 is invalid", None),
    (["parallel.dp_replicate=-3"], "parallel.dp_replicate=-3 is invalid", None),
    (["parallel=fsdp", "launcher.nproc_per_node=3"], "world size is 3", None),  # product
    (["parallel.tp=3"], "parallel.tp=3 does not divide model.n_heads=4", None),
    (["parallel=tp", "parallel.tp=4"], "parallel.tp=4 does not divide model.n_kv_heads=2", None),
    (["parallel.dp_shard=-1"], "set launcher.nproc_per_node", None),  # not inferable
    (["parallel.dp_shard=-1", "launcher.nproc_per_node=3"], "cannot be inferred", None),
    (["parallel=fsdp", "launcher.nproc_per_node=4"], "exceeds the 2 visible GPUs", 2),
    (["device=cuda"], "device=cuda but no GPU is usable: this torch", None),
    (["trainer.global_batch_size=6"], "trainer.global_batch_size=6 is not divisible", None),
    # The MoE feed-forward's recompute on a dense model: nothing to recompute.
    (["parallel.ac=moe"], "model.name=llama3_tiny has no MoE block; set parallel.ac=full", None),
    (["parallel.ac=moe_act"], "model.name=llama3_tiny has no MoE block; set parallel.ac=", None),
    # The experts' float8 matmuls keep their own saved inputs: nothing to recompute from.
    (
        [
            "model=moe_tiny",
            "precision=float8",
            "precision.float8_experts=true",
            "parallel.ac=moe_act",
        ],
        "parallel.ac=moe_act with precision.float8_experts=true",
        None,
    ),
    # Saving sequence parallel's shards through saved-tensor hooks: compiled blocks bypass them.
    (
        ["parallel=tp", "parallel.sp_save_shard=true", "parallel.compile=true"],
        "parallel.sp_save_shard=true with parallel.compile=true",
        None,
    ),
    (
        ["parallel=tp", "model.seq_len=31"],
        "model.seq_len=31 is not divisible by parallel.tp=2",
        None,
    ),
    (
        ["parallel=cp", "parallel.cp=4", "model.seq_len=36"],
        "model.seq_len=36 is not divisible by 2 x parallel.cp=4",
        None,
    ),
    (
        ["parallel=cp", "parallel.tp=2", "model=gpt2_tiny"],
        "set parallel.sequence_parallel=false or parallel.tp=1",
        None,
    ),
    (["precision.param_dtype=float8"], "precision.param_dtype='float8'", None),
    (["parallel=pp", "parallel.pp=4"], "model.n_layers=2 cannot split over 4 pipeline", None),
    (["parallel=pp", "trainer.global_batch_size=6"], "does not split into parallel.pp_micro", None),
    (["parallel=pp", "parallel.pp_microbatches=1"], "parallel.pp_microbatches=1 is fewer", None),
    (["parallel=pp", "parallel.pp_schedule=interleaved_1f1b"], "pp_stages_per_rank=2", None),
    (["parallel=pp", "trainer.grad_accum_steps=2"], "micro-batches are the accumulation", None),
    (["parallel=pp", "parallel.pp_first_stage_less_blocks=4"], "more than its share", None),
    (["parallel=pp", "parallel.pp_last_stage_less_blocks=-1"], "must be >= 0", None),
    (
        [
            "parallel=pp_fsdp",
            "model.n_layers=4",
            "parallel.pp_schedule=interleaved_zb",
            "parallel.pp_stages_per_rank=2",
        ],
        "set parallel.reshard_after_forward=false, or parallel.pp_schedule=interleaved_1f1b",
        None,
    ),
    # The zero-bubble schedule's split backward cannot follow these (pipeline_settings).
    (
        [*ZERO_BUBBLE, "parallel.ac=selective"],
        "parallel.ac=selective fails in torch 2.13: the schedule runs each backward in two",
        None,
    ),
    ([*ZERO_BUBBLE, "parallel.compile=true"], "set parallel.compile=false, or", None),
    (
        [*ZERO_BUBBLE, "parallel.dp_replicate=2", "parallel.ddp_impl=fully_shard"],
        "set parallel.ddp_impl=replicate, or parallel.pp_schedule=interleaved_1f1b",
        None,
    ),
    (
        [*ZERO_BUBBLE, "precision=bf16"],
        "no data parallelism inside the stages and precision.param_dtype=bfloat16 != precision."
        "master_dtype=float32 computes wrong weight gradients",
        None,
    ),
    (
        ["parallel=pp", "parallel.pp_schedule=1F1B"],
        "is not one of gpipe, 1f1b, interleaved_1f1b",
        None,
    ),
    (
        ["parallel=pp", "checkpoint.export_at_end=true"],
        "checkpoint.export_at_end=true with parallel.pp=2 needs checkpoint.enable=true",
        None,
    ),
    (["precision=bf16"], "needs bfloat16, which this GPU does not support", 4),
    # Expert parallel (parallel.ep): a dense model, the ranks it borrows, the experts, float8.
    (["parallel=fsdp", "parallel.ep=2"], "parallel.ep=2 needs a model with experts", None),
    (["parallel.ep=0"], "parallel.ep=0 is invalid; use a positive degree", None),
    (
        ["model=moe_tiny", "parallel=fsdp_tp", "parallel.ep=3"],
        "parallel.ep=3 does not divide parallel.dp_shard x parallel.cp x parallel.tp = 2 x 1 x 2",
        None,
    ),
    (
        ["model=moe_tiny", "parallel=fsdp", "parallel.ep=4", "model.n_experts=6"],
        "parallel.ep=4 does not divide model.n_experts=6",
        None,
    ),
    (
        ["model=moe_tiny", "precision=float8", "precision.float8_experts=true"],
        "float8 grouped matmul runs on GPUs only",
        None,
    ),
    (
        ["precision=bf16", "precision.float8_experts=true"],
        "precision.float8_experts=true with",
        None,
    ),
    (
        ["model=moe_tiny", "parallel=fsdp", "parallel.ep=2", "parallel.compile=true"],
        "compiles the experts' grouped matmul for bfloat16 only",
        None,
    ),
    (
        ["model=moe_tiny", "parallel=fsdp", "parallel.ep=2", "parallel.ep_chunks=0"],
        "parallel.ep_chunks=0 must be >= 1",
        None,
    ),
    (
        ["model=moe_tiny", "precision=bf16", "parallel=fsdp", "parallel.ep=2"]
        + ["parallel.compile=true", "parallel.ep_chunks=2"],
        "parallel.ep_chunks=2 with parallel.compile=true",
        None,
    ),
    (["precision.float8=fp8"], "precision.float8='fp8'", None),
    (
        ["precision=float8_rowwise", "precision.float8_all_gather=true"],
        "precision.float8_all_gather=true with precision.float8=rowwise",
        None,
    ),
    (["precision=float8_rowwise", "parallel=tp"], "float8 tensor-parallel styles assume", None),
    (  # ffn 48 split 2 ways: 24 columns per rank, not a multiple of 16
        ["precision=float8", "parallel=tp", "model.ffn_hidden_dim=48"],
        "use a smaller parallel.tp or widths that are multiples of 16 x tp",
        None,
    ),
    (["data=text", "data.path=/no/such.txt"], "data.path='/no/such.txt' does not exist", None),
    (["data=text", "data.path=EMPTY"], "holds 0 bytes", None),
    (["hydra.run.dir=/proc/hsdp_runner_test"], "is not writable", None),
    (
        ["checkpoint.load_path=/no/such/ckpt"],
        "checkpoint.load_path=/no/such/ckpt does not exist",
        None,
    ),
    (["checkpoint.load_path=EMPTY"], "is neither a checkpoint", None),  # wrong kind
    (["trainer.freeze=[nope.*]"], "trainer.freeze pattern 'nope.*' matches no parameter", None),
    (["trainer.on_nan=ignore"], "trainer.on_nan='ignore'", None),
    (["parallel.ac=sometimes"], "parallel.ac='sometimes'", None),
    (["parallel.compile_backend=tvm"], "parallel.compile_backend='tvm'", None),
    (["logger.mode=cloud"], "logger.mode='cloud'", None),
    (["optim.lr=0"], "optim.lr=0.0 must be positive", None),
    (["metrics.memory_steps=-1"], "metrics.memory_steps=-1 must be >= 0", None),
    (
        ["+trainer.stepz=10"],
        "unknown config key trainer.stepz (added with +); nothing reads it: "
        "did you mean trainer.steps?",
        None,
    ),
    (["+foo.bar=1"], "unknown config key foo", None),
    (["launcher.signal=KILL"], "launcher.signal='KILL'", None),
    (["launcher.requeue=1"], "launcher.requeue=1 needs checkpoint.enable=true", None),
    (
        ["parallel=auto", "launcher.nproc_per_node=2", "parallel.tp=3"],  # auto: a constraint
        "parallel=auto: parallel.tp=3: no layout of 2 ranks has that degree",
        None,
    ),  # none meets
    (  # its training state alone fits nowhere: refused before any layout is measured
        ["parallel=auto", "launcher.nproc_per_node=4", "model=llama3_70b", "cluster=h100_sxm"],
        "parallel=auto: model llama3_70b fits on no layout of 4 x 79.2 GiB devices: its "
        "parameters, gradients and AdamW state alone",
        None,
    ),
    (
        ["parallel=auto"],
        "parallel=auto on CPU needs the number of ranks to plan for and start: "
        "set launcher.nproc_per_node",
        None,
    ),
]


@pytest.fixture
def empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    return path


@pytest.mark.parametrize(
    "overrides, words, gpus", BAD_INPUTS, ids=[" ".join(case[0]) for case in BAD_INPUTS]
)
def test_bad_input_exits_2_naming_key_and_fix_before_any_worker(
    overrides, words, gpus, job_dir, empty_file, monkeypatch, capsys
):
    overrides = [o.replace("EMPTY", str(empty_file)) for o in overrides]
    if gpus is not None:
        monkeypatch.setattr(prelaunch, "usable_gpus", lambda device: gpus)
        monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr("sys.argv", ["hsdp_runner", f"hydra.run.dir={job_dir}", *TINY, *overrides])
    GlobalHydra.instance().clear()
    code = app.main()
    err = capsys.readouterr().err
    assert code == 2, err
    assert words in err
    if "config error:" in err:  # the runner's own checks (not Hydra's): one line
        assert err.strip().count("\n") == 0, err
    assert not (job_dir / "logs").exists()


def test_a_second_run_in_one_process_still_exits_2_on_a_bad_override(job_dir, monkeypatch, capsys):
    """An earlier ``app.main`` in the same process (a sweep, a test) started its task; a later
    call whose overrides Hydra rejects is still a config error, not a crash (exit 1)."""
    monkeypatch.setitem(app._state, "task_started", True)
    monkeypatch.setattr(
        "sys.argv", ["hsdp_runner", f"hydra.run.dir={job_dir}", *TINY, "parallel.tpp=2"]
    )
    GlobalHydra.instance().clear()
    assert app.main() == 2, capsys.readouterr().err


def test_bad_input_from_the_command_line_exits_2(job_dir):
    result = run_cli(job_dir, *TINY, "parallel.tp=3", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("hsdp_runner: config error: parallel.tp=3")
