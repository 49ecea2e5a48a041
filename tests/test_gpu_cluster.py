"""First contact with a GPU cluster, simulated on CPU: device names, visible GPUs, environment
variables and affinity masks a GPU node presents, with ``torch.cuda`` monkeypatched.

Nothing here touches a GPU; README's "On a GPU machine" says what this does and does not prove.
"""

import pytest

from hsdp_runner.metrics import lookup_peak_tflops

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


@pytest.mark.parametrize("name", ["NVIDIA H20", "NVIDIA B100", "NVIDIA GeForce RTX 4090",
                                  "NVIDIA H100X", "NVIDIA L40G", "Some Future GPU", ""])
def test_unknown_or_merely_similar_device_names_get_no_peak(name):
    assert lookup_peak_tflops(name, "bfloat16") is None  # MFU null with a warning, never a guess


def test_fp32_peak_is_the_non_tensor_core_figure():
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "float32") == 67.0
    assert lookup_peak_tflops("NVIDIA L4", "float32") == 30.3
    assert lookup_peak_tflops("NVIDIA B200", "float32") is None  # no datasheet figure we trust


# --- precision checks a GPU makes matter -----------------------------------------------------

def _validate(overrides, tmp_path, gpus=1):
    from hsdp_runner import launch
    from test_config import compose

    cfg = compose(["model=llama3_tiny", "logger=none", "trainer.global_batch_size=8",
                   "device=cuda", f"launcher.nproc_per_node={gpus}", *overrides])
    return launch.validate(cfg, tmp_path)


def test_bf16_emulated_in_software_is_refused(tmp_path, monkeypatch):
    from hsdp_runner.config import ConfigError

    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    # A V100 or T4: torch emulates bf16, is_bf16_supported() alone says True.
    monkeypatch.setattr("torch.cuda.is_bf16_supported",
                        lambda including_emulation=True: including_emulation)
    with pytest.raises(ConfigError, match="precision=bf16 needs bfloat16"):
        _validate(["parallel=single", "precision=bf16"], tmp_path)


@pytest.mark.parametrize("key", ["param_dtype", "reduce_dtype", "master_dtype"])
def test_float16_without_a_gradient_scaler_is_refused(key):
    from hsdp_runner.config import ConfigError, validate_config
    from test_config import compose

    with pytest.raises(ConfigError, match=f"precision.{key}=float16 needs a gradient scaler"):
        validate_config(compose(["model=llama3_tiny", f"precision.{key}=float16"]))


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


def test_one_visible_gpu_per_task_is_used_whatever_the_local_rank(cuda):
    from hsdp_runner.devices import pick_device

    cuda.visible = 1  # SLURM --gpus-per-task=1 / --gpu-bind: each task sees only its own GPU
    assert str(pick_device("auto", 5, 8)) == "cuda:0" and cuda.current == [0]


def test_local_rank_indexes_the_node_gpus(cuda):
    from hsdp_runner.devices import pick_device

    assert str(pick_device("cuda", 3, 8)) == "cuda:3" and cuda.current == [3]


def test_more_local_ranks_than_visible_gpus_is_a_clear_error(cuda, monkeypatch):
    from hsdp_runner.config import ConfigError
    from hsdp_runner.devices import pick_device

    cuda.visible = 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ConfigError, match=r"4 ranks on this node but only 2 GPUs are visible "
                                          r"\(CUDA_VISIBLE_DEVICES=4,5\)"):
        pick_device("auto", 3, 4)
    assert cuda.current == []


def test_torchrun_ranks_outnumbering_visible_gpus_exit_2_before_training(cuda, tmp_path,
                                                                         monkeypatch):
    from hsdp_runner.config import ConfigError

    cuda.visible = 2
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda including_emulation=True: True)
    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="4 ranks on this node but only 2 GPUs"):
        _validate(["parallel=fsdp"], tmp_path)


@pytest.fixture
def gpu_node_without_cuda(monkeypatch, tmp_path):
    """A node whose driver shows 8 NVIDIA GPUs while torch cannot use any (CPU build)."""
    gpus = tmp_path / "root" / "proc/driver/nvidia/gpus"
    for i in range(8):
        (gpus / f"0000:{i:02x}:00.0").mkdir(parents=True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("torch.version.cuda", None)
    monkeypatch.setattr("torch.version.hip", None)
    return tmp_path / "root"


def test_auto_device_on_a_gpu_node_with_a_cpu_torch_warns_naming_the_cause(
        gpu_node_without_cuda):
    from hsdp_runner.devices import cuda_fallback_warning

    warning = cuda_fallback_warning("auto", gpu_node_without_cuda)
    assert "8 NVIDIA GPU(s) present" in warning and "CPU-only build" in warning
    assert "TORCH_SPEC" in warning
    assert cuda_fallback_warning("cpu", gpu_node_without_cuda) is None  # a deliberate choice
    assert cuda_fallback_warning("auto", gpu_node_without_cuda / "nothing") is None  # no GPUs


def test_hidden_gpus_are_named_as_the_cause(gpu_node_without_cuda, monkeypatch):
    from hsdp_runner.devices import cuda_fallback_warning

    monkeypatch.setattr("torch.version.cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES='' hides them" in cuda_fallback_warning("auto",
                                                                        gpu_node_without_cuda)


def test_launch_prints_the_fallback_warning_before_starting_ranks(monkeypatch, tmp_path, capsys):
    from hsdp_runner import launch
    from test_config import compose

    monkeypatch.setattr("hsdp_runner.devices.gpus_present", lambda root=None: (8, "NVIDIA"))
    monkeypatch.setattr("torch.version.cuda", None)
    monkeypatch.setattr("torch.version.hip", None)
    base = ["model=llama3_tiny", "logger=none", "parallel=fsdp"]
    launch.validate(compose(base), tmp_path)
    assert "warning: device=auto: 8 NVIDIA GPU(s) present" in capsys.readouterr().err
    launch.validate(compose(base + ["device=cpu"]), tmp_path)
    assert capsys.readouterr().err == ""


# --- CPU threads from the affinity mask -------------------------------------------------------

def test_threads_come_from_the_affinity_mask_not_the_node_cpu_count(monkeypatch):
    from hsdp_runner.devices import cpu_threads

    monkeypatch.setattr("os.cpu_count", lambda: 224)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_threads(8, env={}) == 2  # 8 local ranks share the 16 CPUs this job may use
    # A SLURM task bound to its own 8 CPUs keeps them all ...
    assert cpu_threads(8, mask=set(range(8)), env={"SLURM_CPUS_PER_TASK": "8"}) == 8
    # ... an unbound task sees the node's allocation, shared by the node's tasks.
    assert cpu_threads(8, mask=set(range(64)), env={"SLURM_CPUS_PER_TASK": "8"}) == 8
    assert cpu_threads(4, mask={0}, env={}) == 1


def test_local_launch_sets_omp_threads_from_the_mask(monkeypatch, tmp_path):
    import os

    from hsdp_runner import launch
    from hsdp_runner.mesh import ParallelDims
    from test_config import compose

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 224)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))
    seen = {}

    def start(fn, nproc, *args, **kwargs):
        seen["threads"] = os.environ["OMP_NUM_THREADS"]
        return {0: None}
    monkeypatch.setattr(launch, "start_local_workers", start)
    cfg = compose(["model=llama3_tiny", "logger=none", "parallel=fsdp", "parallel.dp_shard=2"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 2)
    launch._launch_local({"launcher": {"timeout_s": 5}}, dims, {"output_dir": str(tmp_path)})
    assert seen["threads"] == "3"


def test_a_slurm_rank_sets_its_threads_from_the_mask(monkeypatch):
    import os

    import torch

    from hsdp_runner.devices import set_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    try:
        assert set_cpu_threads(8) == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(before)


# --- NCCL failure semantics ---------------------------------------------------------------------

WATCHDOG_LOG = """\
[rank1] 21:40:01 INFO hsdp_runner: step 2 loss 5.41
[rank1]:[E1122 21:45:02.123 ProcessGroupNCCL.cpp:685] [Rank 1] Watchdog caught collective \
operation timeout: WorkNCCL(SeqNum=812, OpType=_ALLGATHER_BASE, NumelIn=49280, \
NumelOut=98560, Timeout(ms)=300000) ran for 300047 milliseconds before timing out.
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG ID 2 PG GUID 5 Rank 1] Process group watchdog thread terminated with exception
Fatal Python error: Aborted
"""


def test_rank_killed_by_nccl_watchdog_is_reported_with_its_cause_not_signal_6(tmp_path):
    from types import SimpleNamespace

    from hsdp_runner.launch import _failure_message

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank1.log").write_text(WATCHDOG_LOG)
    (logs / "nccl_trace_rank_1").write_bytes(b"\x80")
    failure = SimpleNamespace(message="Signal 6 (SIGABRT) received by PID 4242", exitcode=-6)
    message = _failure_message(failure, logs, 1)
    assert message.startswith("Signal 6 (SIGABRT) received by PID 4242: Watchdog caught "
                              "collective operation timeout: WorkNCCL(SeqNum=812")
    assert f"flight recorder dump: {logs / 'nccl_trace_rank_1'}" in message
    assert "launcher.timeout_s" in message  # the timeout hint now shows


def test_a_python_error_record_is_kept_as_it_is(tmp_path):
    from types import SimpleNamespace

    from hsdp_runner.launch import _failure_message

    (tmp_path / "rank0.log").write_text(WATCHDOG_LOG)
    failure = SimpleNamespace(message={"message": "RuntimeError: boom"}, exitcode=1)
    assert _failure_message(failure, tmp_path, 0) == "RuntimeError: boom"


def test_nccl_settings_dump_the_flight_recorder_into_the_job_logs(tmp_path):
    from hsdp_runner.failures import nccl_failure_env

    env = nccl_failure_env(tmp_path / "logs")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # a timed-out rank ends, never hangs
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "logs" / "nccl_trace_rank_")


# --- one NCCL options object per mesh group ---------------------------------------------------

def test_every_mesh_group_gets_its_own_nccl_options(monkeypatch):
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    from hsdp_runner.mesh import ParallelDims

    class Options:
        _timeout = None
    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("PG", (), {"Options": Options}),
                        raising=False)
    seen = {}

    class FakeMesh:
        def __getitem__(self, names):
            return self

        def _flatten(self, name, backend_override=None):
            seen[name] = backend_override
            return self

    def fake_init(device_type, shape, mesh_dim_names, backend_override):
        seen.update(backend_override)
        return FakeMesh()
    monkeypatch.setattr(device_mesh, "init_device_mesh", fake_init)
    ParallelDims(2, 2, 2, 8).build_mesh("cuda", timeout_s=42)
    assert sorted(seen) == ["dp", "dp_replicate", "dp_shard", "tp"]
    assert {backend for backend, _ in seen.values()} == {"nccl"}
    options = [opts for _, opts in seen.values()]
    assert len({id(o) for o in options}) == 4  # NCCL's split mutates the options it is given
    assert all(o._timeout.total_seconds() == 42 for o in options)


# --- initial weights drawn on the device --------------------------------------------------------

def test_cpu_initial_weights_are_the_same_values_as_before():
    import torch

    from hsdp_runner.models.llama import Llama
    from test_config import compose

    model = Llama(compose(["model=llama3_tiny"]).model)
    model.init_weights(7)
    params = dict(model.named_parameters())
    # Values the CPU draw gave before weights were drawn on the parameter's device.
    golden = {"tok_embeddings.weight": ([0.03461545, 0.00616866, 0.0256436], -0.7227687860532548),
              "layers.1.attention.wo.weight": ([0.00020108, -0.0072222, 0.0139383],
                                               -0.00870523175035487),
              "layers.0.feed_forward.w3.weight": ([0.01364315, 0.0242396, -0.0200923],
                                                  3.9896071250705063),
              "norm.weight": ([1.0, 1.0, 1.0], 64.0)}
    for name, (first, total) in golden.items():
        value = params[name].detach()
        assert value.flatten()[:3].tolist() == pytest.approx(first, abs=1e-8), name
        assert float(value.double().sum()) == pytest.approx(total, rel=1e-12), name
    assert all(p.device == torch.device("cpu") for p in params.values())


def test_initial_values_are_drawn_on_the_parameters_device_by_a_seeded_generator(monkeypatch):
    import torch

    from hsdp_runner.models import llama

    draws = []

    class Generator:  # stands in for a CUDA generator on this CPU-only machine
        def __init__(self, device):
            self.device, self.seed = torch.device(device), None

        def manual_seed(self, seed):
            self.seed = seed
            return self

    def randn(shape, generator, device):
        draws.append((generator.device, generator.seed, torch.device(device)))
        return torch.zeros(shape)
    monkeypatch.setattr(torch, "Generator", Generator)
    monkeypatch.setattr(torch, "randn", randn)
    monkeypatch.setattr(torch, "ones", lambda shape, device: draws.append(device) or "ones")
    gpu = torch.device("cuda", 3)
    llama.initial_value("layers.0.attention.wq.weight", (4, 4), 7, 0.02, gpu)
    llama.initial_value("_orig_mod.layers.0.attention.wq.weight", (4, 4), 7, 0.02, gpu)
    assert draws[0] == (gpu, llama._name_seed(7, "layers.0.attention.wq.weight"), gpu)
    assert draws[1] == draws[0]  # the seed is the name's, whatever wraps the module
    llama.initial_value("layers.0.ffn_norm.weight", (4,), 7, 0.02, gpu)
    assert draws[2] == gpu


# --- rank-0 file work outside the collective timeout ----------------------------------------------

def _in_threads(*fns):
    """Run each fn in a thread; return their results or exceptions, in order."""
    import threading

    out = [None] * len(fns)

    def call(i, fn):
        try:
            out[i] = fn()
        except Exception as err:  # noqa: BLE001 - the test inspects it
            out[i] = err
    threads = [threading.Thread(target=call, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_other_ranks_learn_rank0s_file_error_at_once():
    import time

    import torch.distributed as dist

    from hsdp_runner.rank0_io import run_on_rank0

    store = dist.HashStore()

    def fail():
        raise OSError("No space left on device")
    start = time.monotonic()
    got = _in_threads(lambda: run_on_rank0("pruning", fail, 60, rank=0, store=store),
                      lambda: run_on_rank0("pruning", fail, 60, rank=1, store=store))
    assert isinstance(got[0], OSError)
    assert "rank 0 failed while pruning: OSError: No space left on device" in str(got[1])
    assert time.monotonic() - start < 10


def test_rank0_file_work_is_bounded_by_rank0_wait_s():
    import torch.distributed as dist

    from hsdp_runner.rank0_io import run_on_rank0

    with pytest.raises(RuntimeError, match=r"rank 0 did not finish exporting within "
                                            r"checkpoint.rank0_wait_s=0.2 s"):
        run_on_rank0("exporting", lambda: None, 0.2, rank=1, store=dist.HashStore())


COLLECTIVE_TIMEOUT_S, SLOW_PRUNE_S = 10, 14


def _save_while_rank0_prunes_slowly(out: str) -> list[str]:
    import gc
    import time
    from datetime import timedelta
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from hsdp_runner.checkpoint import Checkpointer
    from hsdp_runner.mesh import ParallelDims
    from hsdp_runner.sharding import build_model
    from hsdp_runner.trainer import Trainer
    from test_config import compose

    cfg = compose(["model=llama3_tiny", "logger=none", "parallel=fsdp", "parallel.dp_shard=2",
                   "metrics.peak_tflops=1", "checkpoint.enable=true", "checkpoint.keep_last=1",
                   f"launcher.timeout_s={COLLECTIVE_TIMEOUT_S}"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        dims = ParallelDims.from_config(cfg.parallel, cfg.model, 2)
        world = dims.build_mesh("cpu", COLLECTIVE_TIMEOUT_S)
        device = torch.device("cpu")
        model = build_model(cfg.model, dims, world, cfg.parallel, cfg.precision, device, 0)
        trainer = Trainer(cfg, dims, world, model, device)
        ckpt = Checkpointer(cfg, dims, Path(out), trainer.model, trainer.optimizer,
                            trainer.scheduler, device)
        prune = ckpt._prune
        ckpt._prune = lambda newest: (time.sleep(SLOW_PRUNE_S), prune(newest))  # a slow NFS
        ckpt.save(1)
        dist.barrier()  # the next collective after the save
        return sorted(p.name for p in ckpt.folder.iterdir())
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_slow_rank0_prune_longer_than_the_collective_timeout_does_not_fail_the_job(tmp_path):
    from hsdp_runner.launch import start_local_workers

    results = start_local_workers(_save_while_rank0_prunes_slowly, 2, str(tmp_path))
    assert results == {0: ["step-1"], 1: ["step-1"]}


# --- single-GPU parts and per-count commands on a multi-GPU node --------------------------------

def _gpu_node(monkeypatch, gpus):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: gpus)
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda including_emulation=True: True)


def _readiness():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_readiness.py"
    spec = importlib.util.spec_from_file_location("gpu_readiness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_gpu_readiness_single_gpu_run_and_every_printed_command_validate_on_a_gpu_node(
        gpus, monkeypatch, tmp_path):
    from hsdp_runner import launch
    from test_config import compose

    _gpu_node(monkeypatch, gpus)
    readiness = _readiness()
    launch.validate(compose(readiness.overrides_for(1, "llama3_1b", 4)), tmp_path)  # the probe
    printed = readiness.commands("llama3_1b", 4, visible=gpus)
    assert gpus in printed and {1, 2, 4, 8} <= set(printed)
    for n, command in printed.items():
        if n > gpus:
            continue  # needs a bigger node
        assert command.startswith("python -m hsdp_runner ")
        dims = launch.validate(compose(command.split()[3:]), tmp_path)
        assert dims.world_size == n and dims.dp == n


def test_parity_runs_each_layout_on_its_own_rank_count_on_a_gpu_node(monkeypatch, tmp_path):
    from hsdp_runner import launch, parity

    _gpu_node(monkeypatch, 8)
    sizes = {layout: launch.validate(parity.compose(layout, ["model=llama3_tiny"]),
                                     tmp_path / layout).world_size
             for layout in ("single", "ddp", "tp", "hsdp_tp")}
    assert sizes == {"single": 1, "ddp": 2, "tp": 2, "hsdp_tp": 8}


def test_parity_tolerance_on_gpu_says_what_it_is_and_why(monkeypatch, tmp_path):
    from hsdp_runner import parity

    _gpu_node(monkeypatch, 8)
    args = parity.parse_args(["--out", str(tmp_path)])
    assert args.rtol == parity.GPU_RTOL and "cuBLAS" in args.rtol_why
    header = parity.format_table([], args.rtol, args.rtol_why).splitlines()[0]
    assert "tolerance 1e-04 relative; GPU default: cuBLAS picks different fp32 kernels" in header
    assert parity.parse_args(["--out", str(tmp_path), "device=cpu"]).rtol == parity.CPU_RTOL
    assert parity.parse_args(["--out", str(tmp_path), "--rtol", "3e-5"]).rtol == 3e-5


# --- the Makefile replaces torch when TORCH_SPEC changes -----------------------------------------

def _make_venv(venv, spec):
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(["make", "-s", "-C", str(repo), "venv", f"VENV={venv}",
                             f"TORCH_SPEC={spec}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = (venv / "calls.log").read_text().splitlines() if (venv / "calls.log").exists() else []
    (venv / "calls.log").unlink(missing_ok=True)
    return calls


def test_make_replaces_torch_when_torch_spec_changes_and_only_then(tmp_path):
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"  # records what make asks of the venv's python
    python.write_text(f'#!/bin/sh\necho "$*" >> {venv / "calls.log"}\n')
    python.chmod(0o755)
    cpu, cuda = "torch==2.13.0", "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
    first = _make_venv(venv, cpu)
    assert any(c.endswith(f"install --quiet --disable-pip-version-check {cpu}") for c in first)
    assert any(".[test]" in c for c in first)
    assert _make_venv(venv, cpu) == []  # nothing changed: nothing reinstalled
    switched = _make_venv(venv, cuda)
    assert any("uninstall" in c and c.endswith("-y torch") for c in switched)
    assert any(c.endswith(f"install --quiet --disable-pip-version-check {cuda}") for c in switched)
    assert (venv / ".torch-spec").read_text().strip() == cuda
    assert _make_venv(venv, cuda) == []
