"""A GPU node simulated on CPU, part 3: the readiness benchmark and parity on a multi-GPU node,
and the Makefile's torch stamp. README's "On a GPU machine" says what this does not prove.
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
        gpus, monkeypatch, tmp_path):
    from test_config import compose

    from hsdp_runner.runtime import launch

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
    from hsdp_runner import parity
    from hsdp_runner.runtime import launch

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
