"""A GPU node simulated on CPU, part 3: the readiness benchmark and parity on a multi-GPU node,
and the Makefile's torch stamp. docs/gpu.md says what this does not prove.
"""

import pytest

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
    gpus, monkeypatch, tmp_path
):
    from test_config import compose

    from hsdp_runner.runtime import prelaunch

    _gpu_node(monkeypatch, gpus)
    readiness = _readiness()
    prelaunch.validate(compose(readiness.overrides_for(1, "llama3_1b", 4)), tmp_path)  # the probe
    printed = readiness.commands("llama3_1b", 4, visible=gpus)
    assert gpus in printed and {1, 2, 4, 8} <= set(printed)
    for n, command in printed.items():
        if n > gpus:
            continue  # needs a bigger node
        assert command.startswith("python -m hsdp_runner ")
        dims = prelaunch.validate(compose(command.split()[3:]), tmp_path)
        assert dims.world_size == n and dims.dp == n


def test_gpu_readiness_names_why_torch_cannot_use_the_gpus(monkeypatch, capsys):
    import warnings

    from test_gpu_devices import OLD_DRIVER

    from hsdp_runner.distributed import hardware

    def is_available():
        warnings.warn(OLD_DRIVER, stacklevel=1)  # as torch warns: from is_available itself
        return False

    monkeypatch.setattr(hardware, "_cuda_init_warning", None)
    monkeypatch.setattr("torch.cuda.is_available", is_available)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)  # NVML's count
    monkeypatch.setattr("torch.version.cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # not hidden: the driver is why
    monkeypatch.setattr("sys.argv", ["gpu_readiness.py"])
    assert _readiness().main() == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU is visible" not in out
    assert "torch cannot use a GPU here: torch" in out and "(CUDA 12.8) cannot use them" in out
    assert "driver on your system is too old (found version 11040)" in out


def test_gpu_readiness_reports_the_nccl_setting_and_the_attention_kernel(monkeypatch, capsys):
    readiness = _readiness()
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    # A machine where torch can use no GPU, even when the test runs on one: the script probes
    # the kernel on the device torch says it can use, and the CPU's is the one checked here.
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    readiness.report_checks()
    out = capsys.readouterr().out
    assert "torch.cuda.is_available()=False" in out
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING: unset here" in out
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in out  # torchrun's agent would give 1
    # On the CPU SDPA runs CPU's flash kernel, which selective AC saves.
    assert (
        "attention runs aten._scaled_dot_product_flash_attention_for_cpu: saved by "
        "parallel.ac=selective (cpu)" in out
    )


def test_parity_runs_each_layout_on_its_own_rank_count_on_a_gpu_node(monkeypatch, tmp_path):
    from hsdp_runner import parity
    from hsdp_runner.runtime import prelaunch

    _gpu_node(monkeypatch, 8)
    sizes = {
        layout: prelaunch.validate(
            parity.compose(layout, ["model=llama3_tiny"]), tmp_path / layout
        ).world_size
        for layout in ("single", "ddp", "tp", "hsdp_tp")
    }
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


def _make_venv(venv, spec, ok=True):
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        ["make", "-s", "-C", str(repo), "venv", f"VENV={venv}", f"TORCH_SPEC={spec}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode == 0) == ok, result.stderr
    calls = (venv / "calls.log").read_text().splitlines() if (venv / "calls.log").exists() else []
    (venv / "calls.log").unlink(missing_ok=True)
    return calls


def test_make_replaces_torch_when_torch_spec_changes_and_keeps_it_when_the_install_fails(tmp_path):
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"  # records what make asks of the venv's python
    # ... and fails any install from an index it cannot reach, as pip would.
    python.write_text(
        f'#!/bin/sh\necho "$*" >> {venv / "calls.log"}\ncase "$*" in *unreachable*) exit 1;; esac\n'
    )
    python.chmod(0o755)
    cpu, cuda = "torch==2.13.0", "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
    install = "install --quiet --disable-pip-version-check --force-reinstall"
    first = _make_venv(venv, cpu)
    assert any(c.endswith(f"{install} {cpu}") for c in first)
    assert any(".[test]" in c for c in first)
    assert _make_venv(venv, cpu) == []  # nothing changed: nothing reinstalled
    switched = _make_venv(venv, cuda)
    assert any(c.endswith(f"{install} {cuda}") for c in switched)
    assert not any("uninstall" in c for c in switched)  # never without a replacement
    assert (venv / ".torch-spec").read_text().strip() == cuda
    assert _make_venv(venv, cuda) == []
    failed = _make_venv(venv, "torch==2.13.0 --index-url https://unreachable.invalid", ok=False)
    assert not any("uninstall" in c for c in failed) and len(failed) == 1
    assert (venv / ".torch-spec").read_text().strip() == cuda  # the old torch is still the one


# --- NCCL's error handling reaches the workers of the local launcher ----------------------------


def _nccl_error_handling() -> str | None:
    import os

    return os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")


@pytest.mark.multiprocess
def test_a_worker_of_the_local_launcher_sees_async_error_handling_3(monkeypatch):
    """torch's elastic agent writes its own default (1) into each worker's environment (read in
    torch 2.13's local_elastic_agent.py); the launcher sets ours before the workers start."""
    import os

    from hsdp_runner.runtime.launch import start_local_workers

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "unset")  # restored after the test
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    assert start_local_workers(_nccl_error_handling, 1) == {0: "3"}
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ  # set for the launch only


def test_a_users_async_error_handling_reaches_the_agent_unchanged(monkeypatch):
    from torch.distributed.launcher import api

    from hsdp_runner.runtime.launch import start_local_workers

    seen = []
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setattr(
        api,
        "elastic_launch",
        lambda config, fn: lambda *a: seen.append(_nccl_error_handling()) or {0: None},
    )
    start_local_workers(_nccl_error_handling, 1)
    assert seen == ["1"] and _nccl_error_handling() == "1"


# --- a CUDA context does not survive fork: the forkserver must not hold one ---------------------


def test_an_import_that_initialises_cuda_in_the_forkserver_is_named_in_the_worker(monkeypatch):
    from types import SimpleNamespace

    from hsdp_runner.runtime import forkserver

    state = {"initialised": False}

    def import_module(name):  # "cuda_at_import" calls into CUDA at import time
        state["initialised"] |= name == "cuda_at_import"

    monkeypatch.setattr(forkserver, "importlib", SimpleNamespace(import_module=import_module))
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: state["initialised"])
    monkeypatch.setattr(forkserver, "_cuda_initialised_by", None)
    assert (
        forkserver.import_worker_modules(("json", "cuda_at_import", "os"))
        == "importing cuda_at_import"
    )
    monkeypatch.setattr(forkserver, "_server_env", {})  # as in a worker forked from the server
    ran = []
    with pytest.raises(
        RuntimeError,
        match=r"CUDA was initialised in the forkserver \(importing "
        r"cuda_at_import\) before this worker was forked",
    ):
        forkserver.run_forked({}, ran.append, "trained")
    assert ran == []  # before any device setup


def test_a_worker_forked_after_the_server_touched_the_driver_fails_before_device_setup(monkeypatch):
    from hsdp_runner.runtime import forkserver

    # torch.cuda.is_available() in the server initialises the driver without torch's CUDA
    # state: the forked child is then in torch's "bad fork" state (read in torch/cuda/__init__.py).
    monkeypatch.setattr("torch.cuda._is_in_bad_fork", lambda: True)
    monkeypatch.setattr(forkserver, "_cuda_initialised_by", None)
    monkeypatch.setattr(forkserver, "_server_env", {})
    with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
        forkserver.run_forked({}, print)
    monkeypatch.setattr("torch.cuda._is_in_bad_fork", lambda: False)
    monkeypatch.setattr(forkserver, "_server_env", None)  # spawned, not forked: no check
    assert forkserver.run_forked({}, len, "ab") == 2


def test_an_older_torch_launch_config_without_shutdown_timeout_gets_it_through_the_environment():
    """torch 2.11 (the CUDA image of a real H100 machine) has no LaunchConfig.shutdown_timeout
    nor signals_to_handle: the launch passes them as the agent's environment variables instead
    of failing every local job with a TypeError; a field nobody knows still fails. The exact
    checks use stand-ins for the old and new class, so the verdict does not depend on the torch
    installed here; the installed torch's own class is only checked to build either way."""
    import dataclasses

    from hsdp_runner.runtime.launch import launch_config

    @dataclasses.dataclass
    class OldLaunchConfig:  # torch 2.11's: neither field
        min_nodes: int
        max_nodes: int
        monitor_interval: float = 0.1

    @dataclasses.dataclass
    class NewLaunchConfig(OldLaunchConfig):  # torch 2.13's: both fields
        shutdown_timeout: int = 30
        signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

    config, env = launch_config(
        OldLaunchConfig,
        min_nodes=1,
        max_nodes=1,
        monitor_interval=0.5,
        shutdown_timeout=45,
        signals_to_handle="SIGHUP,SIGQUIT",
    )
    assert config == OldLaunchConfig(1, 1, 0.5)
    assert env == {
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGHUP,SIGQUIT",
    }
    config, env = launch_config(
        NewLaunchConfig, min_nodes=1, max_nodes=1, shutdown_timeout=45, signals_to_handle="SIGHUP"
    )
    assert config == NewLaunchConfig(1, 1, 0.1, 45, "SIGHUP") and env == {}
    # The installed torch's own class is built either way: the field, or its variable.
    from torch.distributed.launcher.api import LaunchConfig

    config, env = launch_config(
        LaunchConfig, min_nodes=1, max_nodes=1, nproc_per_node=1, shutdown_timeout=45
    )
    assert (getattr(config, "shutdown_timeout", None), env) in (
        (45, {}),
        (None, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}),
    )
    with pytest.raises(TypeError):
        launch_config(OldLaunchConfig, min_nodes=1, max_nodes=1, no_such_field=1)
