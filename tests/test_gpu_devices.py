"""A GPU node simulated on CPU, part 1: device names and peaks, precision, which GPU a rank
uses, why GPUs go unused, CPU threads. ``torch.cuda`` is monkeypatched; nothing touches a GPU.
docs/gpu.md says what this does and does not prove.
"""

import pytest
import torch

from hsdp_runner.train.metrics import lookup_peak_tflops

# Real torch.cuda.get_device_name() strings -> dense bf16 peak TFLOP/s (datasheets, no sparsity).
DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": 989.5,
    "NVIDIA H100 PCIe": 756.5,
    "NVIDIA H100 NVL": 835.5,
    "NVIDIA H200": 989.5,
    "NVIDIA H200 NVL": 835.5,
    "NVIDIA GH200 480GB": 989.5,
    "NVIDIA B200": 2250.0,
    "NVIDIA GB200": 2500.0,
    "NVIDIA H800": 989.5,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA L40S": 362.05,
    "NVIDIA L40": 181.05,
    "NVIDIA L4": 121.0,
    "AMD Instinct MI300X": 1307.4,
}


@pytest.mark.parametrize("name, peak", DEVICE_NAMES.items())
def test_peak_table_matches_real_device_names_exactly(name, peak):
    assert lookup_peak_tflops(name, "bfloat16") == peak


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H20",
        "NVIDIA B100",
        "NVIDIA GeForce RTX 4090",
        "NVIDIA H100X",
        "NVIDIA L40G",
        "Some Future GPU",
        "",
    ],
)
def test_unknown_or_merely_similar_device_names_get_no_peak(name):
    assert lookup_peak_tflops(name, "bfloat16") is None  # MFU null with a warning, never a guess


def test_fp32_peak_is_the_non_tensor_core_figure():
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "float32") == 67.0
    assert lookup_peak_tflops("NVIDIA L4", "float32") == 30.3
    assert lookup_peak_tflops("NVIDIA B200", "float32") is None  # no datasheet figure we trust


# --- precision checks a GPU makes matter -----------------------------------------------------


def _validate(overrides, tmp_path, gpus=1):
    from test_config import compose

    from hsdp_runner.runtime import prelaunch

    cfg = compose(
        [
            "model=llama3_tiny",
            "logger=none",
            "trainer.global_batch_size=8",
            "device=cuda",
            f"launcher.nproc_per_node={gpus}",
            *overrides,
        ]
    )
    return prelaunch.validate(cfg, tmp_path)


def test_bf16_emulated_in_software_is_refused(tmp_path, monkeypatch):
    from hsdp_runner.core.errors import ConfigError

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    # A V100 or T4: torch emulates bf16, is_bf16_supported() alone says True.
    monkeypatch.setattr(
        "torch.cuda.is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    with pytest.raises(ConfigError, match="precision=bf16 needs bfloat16"):
        _validate(["parallel=single", "precision=bf16"], tmp_path)


def _gpu(monkeypatch, capability, name):
    """One visible GPU of ``capability`` named ``name`` (bf16 in hardware)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda device=None: capability)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda device=None: name)


def test_float8_on_a_gpu_without_float8_tensor_cores_is_refused(tmp_path, monkeypatch):
    from hsdp_runner.core.errors import ConfigError

    _gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")  # bf16 yes, float8 no
    with pytest.raises(ConfigError, match=r"needs float8 tensor cores .* A100-SXM4-80GB is 8\.0"):
        _validate(["parallel=single", "precision=float8"], tmp_path)


def test_float8_on_an_h100_is_allowed_and_never_emulated(tmp_path, monkeypatch):
    """Validation passes on 9.0, and the GPU's linears run real float8 matmuls; the CPU's
    (the only place torchao emulates) the emulated ones."""
    from test_config import compose

    from hsdp_runner.core.choices import DPMode
    from hsdp_runner.distributed import float8
    from hsdp_runner.models.base import model_spec

    _gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    _validate(["parallel=single", "precision=float8"], tmp_path)
    cfg = compose(["model=llama3_tiny", "precision=float8"])
    emulated = {}
    for device in ("cuda", "cpu"):
        with torch.device("meta"):
            model = model_spec(cfg.model).build()
        names = float8.convert(
            model, cfg.precision, torch.device(device), DPMode.fsdp, cfg.model.vocab_size
        )
        linears = dict(model.named_modules())
        emulated[device] = {linears[n].config.emulate for n in names}
    assert emulated == {"cuda": {False}, "cpu": {True}}


@pytest.mark.parametrize("key", ["param_dtype", "reduce_dtype", "master_dtype"])
def test_float16_without_a_gradient_scaler_is_refused(key):
    from test_config import compose

    from hsdp_runner.config.checks import validate_config
    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.core.errors import ConfigError

    with pytest.raises(ConfigError, match=f"precision.{key}=float16 needs a gradient scaler"):
        validate_config(to_run_config(compose(["model=llama3_tiny", f"precision.{key}=float16"])))


# --- device choice: what is visible, and why GPUs go unused ------------------------------------


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda as a GPU node shows it: ``cuda.visible = n`` GPUs; set_device calls recorded."""

    class Cuda:
        visible, current = 8, []

    monkeypatch.setattr("torch.cuda.is_available", lambda: Cuda.visible > 0)
    monkeypatch.setattr("torch.cuda.device_count", lambda: Cuda.visible)
    monkeypatch.setattr("torch.cuda.set_device", Cuda.current.append)
    return Cuda


def test_one_visible_gpu_per_task_is_used_whatever_the_local_rank(cuda, monkeypatch):
    from hsdp_runner.distributed.hardware import pick_device

    cuda.visible = 1  # SLURM --gpus-per-task=1 / --gpu-bind: each task sees only its own GPU
    monkeypatch.setenv("SLURM_PROCID", "5")  # a SLURM task of launcher=slurm, no torchrun agent
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert str(pick_device("auto", 5, 8)) == "cuda:0" and cuda.current == [0]


@pytest.mark.parametrize("slurm", [False, True])  # torchrun alone, or srun torchrun
def test_one_visible_gpu_under_torchrun_is_not_shared_by_its_ranks(
    cuda, monkeypatch, tmp_path, slurm
):
    from hsdp_runner.core.errors import ConfigError
    from hsdp_runner.distributed.hardware import pick_device

    # CUDA_VISIBLE_DEVICES=3 torchrun --nproc-per-node 2: both ranks see the one GPU.
    cuda.visible = 1
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda including_emulation=True: True)
    env = {
        "CUDA_VISIBLE_DEVICES": "3",
        "TORCHELASTIC_RUN_ID": "j",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        **({"SLURM_PROCID": "0"} if slurm else {}),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(
        ConfigError,
        match=r"2 ranks on this node but only 1 GPUs are visible "
        r"\(CUDA_VISIBLE_DEVICES=3\)",
    ):
        _validate(["parallel=ddp"], tmp_path)  # exit 2 before NCCL's "Duplicate GPU detected"
    with pytest.raises(ConfigError, match="2 ranks on this node but only 1 GPUs"):
        pick_device("cuda", 1, 2)
    assert str(pick_device("cuda", 0, 1)) == "cuda:0"  # one rank on the node: its GPU


def test_local_rank_indexes_the_node_gpus(cuda):
    from hsdp_runner.distributed.hardware import pick_device

    assert str(pick_device("cuda", 3, 8)) == "cuda:3" and cuda.current == [3]


def test_more_local_ranks_than_visible_gpus_is_a_clear_error(cuda, monkeypatch):
    from hsdp_runner.core.errors import ConfigError
    from hsdp_runner.distributed.hardware import pick_device

    cuda.visible = 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(
        ConfigError,
        match=r"4 ranks on this node but only 2 GPUs are visible "
        r"\(CUDA_VISIBLE_DEVICES=4,5\)",
    ):
        pick_device("auto", 3, 4)
    assert cuda.current == []


def test_torchrun_ranks_outnumbering_visible_gpus_exit_2_before_training(
    cuda, tmp_path, monkeypatch
):
    from hsdp_runner.core.errors import ConfigError

    cuda.visible = 2
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda including_emulation=True: True)
    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="4 ranks on this node but only 2 GPUs"):
        _validate(["parallel=fsdp"], tmp_path)


@pytest.fixture
def cpu_torch(monkeypatch):
    """A CPU-only torch build as torch itself shows it: no CUDA or ROCm version, no GPU
    available, none counted. All four are set, so that on a GPU host with a CUDA build the
    real GPU is never what the code under test sees."""
    monkeypatch.setattr("torch.version.cuda", None)
    monkeypatch.setattr("torch.version.hip", None)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)


@pytest.fixture
def gpu_node_without_cuda(cpu_torch, tmp_path):
    """A node whose driver shows 8 NVIDIA GPUs while torch cannot use any (CPU build)."""
    gpus = tmp_path / "root" / "proc/driver/nvidia/gpus"
    for i in range(8):
        (gpus / f"0000:{i:02x}:00.0").mkdir(parents=True)
    return tmp_path / "root"


def test_auto_device_on_a_gpu_node_with_a_cpu_torch_warns_naming_the_cause(gpu_node_without_cuda):
    from hsdp_runner.distributed.hardware import cuda_fallback_warning

    warning = cuda_fallback_warning("auto", gpu_node_without_cuda)
    assert "8 NVIDIA GPU(s) present" in warning and "CPU-only build" in warning
    assert "TORCH_SPEC" in warning
    assert cuda_fallback_warning("cpu", gpu_node_without_cuda) is None  # a deliberate choice
    assert cuda_fallback_warning("auto", gpu_node_without_cuda / "nothing") is None  # no GPUs


def test_hidden_gpus_are_named_as_the_cause(gpu_node_without_cuda, monkeypatch):
    from hsdp_runner.distributed.hardware import cuda_fallback_warning

    monkeypatch.setattr("torch.version.cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES='' hides them" in cuda_fallback_warning(
        "auto", gpu_node_without_cuda
    )


def test_launch_prints_the_fallback_warning_before_starting_ranks(
    cpu_torch, monkeypatch, tmp_path, capsys
):
    from test_config import compose

    from hsdp_runner.runtime import prelaunch

    monkeypatch.setattr(
        "hsdp_runner.distributed.hardware.gpus_present", lambda root=None: (8, "NVIDIA")
    )
    base = ["model=llama3_tiny", "logger=none", "parallel=fsdp"]
    prelaunch.validate(compose(base), tmp_path)
    assert "warning: device=auto: 8 NVIDIA GPU(s) present" in capsys.readouterr().err
    prelaunch.validate(compose(base + ["device=cpu"]), tmp_path)
    assert capsys.readouterr().err == ""


# Torch's warning when CUDA cannot initialise (wording read in c10/cuda/CUDAFunctions.cpp; the
# C++ sources are not in the wheel and no GPU here has shown it).
OLD_DRIVER = (
    "CUDA initialization: The NVIDIA driver on your system is too old (found version "
    "11040). Please update your GPU driver by downloading and installing a new version "
    "from the URL: http://www.nvidia.com/Download/index.aspx Alternatively, go to: "
    "https://pytorch.org to install a PyTorch version that has been compiled with "
    "your version of the CUDA driver."
)


@pytest.fixture
def driver_too_old(monkeypatch):
    """8 GPUs counted through NVML while torch cannot use them: its CUDA 12.8 wheel needs a
    newer driver (``device_count()`` > 0, ``is_available()`` False, torch's warning once)."""
    import warnings

    from hsdp_runner.distributed import hardware

    def is_available():
        warnings.warn(OLD_DRIVER, stacklevel=1)  # as torch warns: from is_available itself
        return False

    monkeypatch.setattr(hardware, "_cuda_init_warning", None)
    monkeypatch.setattr("torch.cuda.is_available", is_available)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr("torch.version.cuda", "12.8")
    monkeypatch.setattr(hardware, "gpus_present", lambda root=None: (8, "NVIDIA"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # not hidden: the driver is why


def test_gpus_torch_cannot_use_are_not_counted_and_the_driver_is_named(
    driver_too_old, tmp_path, capsys
):
    from test_config import compose

    from hsdp_runner.core.errors import ConfigError
    from hsdp_runner.runtime import prelaunch

    base = ["model=llama3_tiny", "logger=none", "parallel=fsdp", "precision=bf16"]
    dims = prelaunch.validate(compose(base), tmp_path)  # not "this GPU does not support bfloat16"
    assert dims.world_size == 4  # the CPU layout: no GPU counted
    err = capsys.readouterr().err
    assert "8 NVIDIA GPU(s) present but torch" in err and "(CUDA 12.8) cannot use them" in err
    assert "driver on your system is too old (found version 11040)" in err
    with pytest.raises(
        ConfigError,
        match=r"device=cuda but no GPU is usable: torch .* \(CUDA "
        r"12.8\) cannot use them: CUDA initialization: The "
        r"NVIDIA driver on your system is too old",
    ):
        prelaunch.validate(compose(base + ["device=cuda", "launcher.nproc_per_node=8"]), tmp_path)


def test_a_cpu_torch_with_device_cuda_says_it_is_a_cpu_build(cpu_torch, tmp_path):
    from hsdp_runner.core.errors import ConfigError
    from hsdp_runner.distributed.hardware import pick_device

    with pytest.raises(ConfigError, match="no GPU is usable: this torch .* is a CPU-only build"):
        _validate(["parallel=single"], tmp_path)
    with pytest.raises(ConfigError, match="CPU-only build"):
        pick_device("cuda", 0, 1)


# --- peak tensor memory on CUDA: the meter's window, not the whole run --------------------------


def test_cuda_tensor_peak_is_read_once_at_the_end_of_its_window(monkeypatch):
    import torch

    from hsdp_runner.train.tensor_memory import GIB, TensorMemoryMeter

    allocator = {"now": 1 * GIB, "max": 1 * GIB}  # stands in for the CUDA caching allocator
    monkeypatch.setattr("torch.cuda.memory_allocated", lambda device=None: allocator["now"])
    monkeypatch.setattr("torch.cuda.max_memory_allocated", lambda device=None: allocator["max"])
    meter = TensorMemoryMeter(torch.device("cuda", 0), steps=2)
    meter.start()
    allocator["max"] = 4 * GIB  # model and the first two steps
    hook = meter.wrap(None, start_step=0)
    hook(1)
    assert meter.peak_gib is None
    hook(2)  # the meter's last step
    assert meter.peak_gib == 3.0
    allocator["max"] = 9 * GIB  # a checkpoint save, later steps
    hook(3)
    assert meter.stop() == 3.0 and meter.peak_gib == 3.0


# --- selective activation checkpointing saves attention whichever kernel runs -----------------


def test_selective_ac_saves_every_fused_attention_kernel_of_this_torch():
    """The SDPA forward kernels come from torch.ops.aten itself; which of them CUDA picks
    (cuDNN on sm90 in newer torch) was read in torch's sources, not seen here."""
    from types import SimpleNamespace

    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from hsdp_runner.distributed.parallelize import selective_policy

    aten = torch.ops.aten
    fused = [
        name
        for name in dir(aten)
        if name.startswith("_scaled_dot_product_")
        and not name.endswith("_backward")
        and "math" not in name
    ]
    assert "_scaled_dot_product_cudnn_attention" in fused  # present in 2.13
    policy = selective_policy()
    ctx = SimpleNamespace(is_recompute=False)
    for name in fused:
        assert policy(ctx, getattr(aten, name).default) is CheckpointPolicy.MUST_SAVE, name
    assert policy(ctx, aten.silu.default) is CheckpointPolicy.PREFER_RECOMPUTE


# --- CPU threads from the affinity mask -------------------------------------------------------


def test_threads_come_from_the_affinity_mask_not_the_node_cpu_count(monkeypatch):
    from hsdp_runner.distributed.hardware import cpu_threads

    monkeypatch.setattr("os.cpu_count", lambda: 224)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_threads(8, env={}) == 2  # 8 local ranks share the 16 CPUs this job may use
    # A SLURM task bound to its own 8 CPUs keeps them all ...
    assert cpu_threads(8, mask=set(range(8)), env={"SLURM_CPUS_PER_TASK": "8"}) == 8
    # ... an unbound task sees the node's allocation, shared by the node's tasks.
    assert cpu_threads(8, mask=set(range(64)), env={"SLURM_CPUS_PER_TASK": "8"}) == 8
    assert cpu_threads(4, mask={0}, env={}) == 1


@pytest.mark.parametrize("slurm_cpus", [None, "6"])
def test_local_launch_sets_omp_threads_from_the_mask(monkeypatch, tmp_path, slurm_cpus):
    """Two local workers share this process's 6 CPUs: 3 threads each, also inside a SLURM
    task bound to those 6 (its workers are its children)."""
    import os

    from test_config import compose

    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.runtime import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if slurm_cpus is None:
        monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    else:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", slurm_cpus)
    monkeypatch.setattr("os.cpu_count", lambda: 224)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))
    seen = {}

    def start(fn, nproc, *args, **kwargs):
        seen["threads"] = os.environ["OMP_NUM_THREADS"]
        return {0: None}

    monkeypatch.setattr(launch, "start_local_workers", start)
    cfg = compose(["model=llama3_tiny", "logger=none", "parallel=fsdp", "parallel.dp_shard=2"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 2)
    from hsdp_runner.config.compose import to_run_config
    from hsdp_runner.core.records import RunInfo

    run_info = RunInfo(
        output_dir=str(tmp_path), group="g", run_name="r", tags=[], multirun=False, overrides=[]
    )
    launch._launch_local(to_run_config(cfg), dims, run_info)
    assert seen["threads"] == "3"


def test_a_slurm_rank_sets_its_threads_from_the_mask(monkeypatch):
    import os

    import torch

    from hsdp_runner.distributed.hardware import set_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    try:
        assert set_cpu_threads(8) == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(before)
