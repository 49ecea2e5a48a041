"""The peak MFU divides by: the dtypes a step's matmuls really run in (emulated float8 on the
CPU multiplies in float32), a CPU figure that a step beats measured again, MFU never above 1,
and a CPU peak that a busy machine cannot poison (for jobs and for ``cluster=this_machine``).
Every measurement here is faked: no test times anything."""

import json
import re

import pytest
import torch
from clusters import quiet_load
from test_config import compose

from hsdp_runner.distributed import cpu_peak
from hsdp_runner.train import metrics

QUIET = cpu_peak.MachineLoad(measured_at=0.0, loadavg=0.0, own_load=0.0, cpus=2)
BUSY = cpu_peak.MachineLoad(measured_at=0.0, loadavg=6.0, own_load=0.5, cpus=2)


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """Point the cache at ``tmp_path`` and fake the matmul measurement: returns the dict
    {dtype name: (TFLOP/s, MachineLoad)} the fake reads, with the calls in ``["calls"]``."""
    monkeypatch.setenv("HSDP_RUNNER_CACHE_DIR", str(tmp_path))
    figures = {"calls": []}

    def measure(dtype, ranks):
        name = str(dtype).removeprefix("torch.")
        figures["calls"].append(name)
        tflops, load = figures[name]
        return cpu_peak.CpuPeak(tflops, load)

    monkeypatch.setattr(cpu_peak, "measure_cpu_peak", measure)
    return figures


def _emulated_matmul_dtypes(recipe: str) -> list[tuple[str, str]]:
    """The dtypes of the plain-tensor matmuls torchao's emulated float8 linear runs in one
    forward and backward (``torch.mm`` is what its emulation calls)."""
    import dataclasses

    from hsdp_runner.distributed import float8

    ao = float8.torchao_float8()
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False)).to(torch.bfloat16)
    ao.convert_to_float8_training(model, config=config)
    seen, real = [], torch.mm

    def mm(a, b, *rest, **kwargs):
        if type(a) is torch.Tensor and type(b) is torch.Tensor:
            seen.append((str(a.dtype), str(b.dtype)))
        return real(a, b, *rest, **kwargs)

    torch.mm = mm
    try:
        x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
        model(x).float().sum().backward()
    finally:
        torch.mm = real
    return seen


def test_emulated_float8_matmuls_run_in_float32_and_a_float8_job_on_cpu_divides_by_that_peak(
    measured,
):
    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.models.base import build_meta_model, model_spec
    from hsdp_runner.train import figures

    # What torchao really does on the CPU: its three float8 matmuls upcast to float32.
    f32 = f"torch.{figures.EMULATED_FLOAT8_DTYPE}"
    assert _emulated_matmul_dtypes("tensorwise") == [(f32, f32)] * 3
    # rowwise_with_gw_hp keeps the grad-weight matmul in the compute dtype.
    gw_hp = _emulated_matmul_dtypes("rowwise_with_gw_hp")
    assert sorted(gw_hp) == sorted([(f32, f32)] * 2 + [("torch.bfloat16",) * 2])

    measured.update(float32=(0.1, QUIET), bfloat16=(0.0004, QUIET))
    cfg = compose(["model=llama3_tiny", "precision=float8", "metrics.comm_step=null"])
    model = build_meta_model(cfg.model)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1)
    run = figures.compute_run_figures(cfg, dims, model, torch.device("cpu"))
    # llama3_tiny's block linears all convert (widths multiples of 16): their 6 FLOPs per
    # weight run in float32, the output layer and attention in bf16.
    spec = model_spec(cfg.model)
    kept = {"output"}
    f8_weights = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name not in kept
    )
    share = 6.0 * f8_weights / spec.flops_per_token()
    expected = 1.0 / (share / 0.1 + (1.0 - share) / 0.0004)
    assert run.peak_tflops == pytest.approx(expected)
    assert "float32" in run.peak_source and "bfloat16" in run.peak_source
    assert sorted(measured["calls"]) == ["bfloat16", "float32"]


def test_a_cached_cpu_peak_a_step_beats_is_measured_again_and_the_cache_rewritten(
    measured, tmp_path
):
    cache = tmp_path / "cpu_peak.json"
    key = cpu_peak.cpu_key("float32")
    cache.write_text(json.dumps({key: {"tflops": 0.001, "load": quiet_load()}}))
    measured["float32"] = (0.05, QUIET)
    peak = metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None)
    assert peak.tflops == 0.001 and not measured["calls"] and "cached" in peak.source
    # One step of 1e9 FLOPs per token x 10 tokens per second: 0.01 TFLOP/s, above 0.001.
    record = metrics.step_record(3, 1.0, 1.0, 1e-3, 1.0, 10, 1, 1e9, peak, 0.1)
    assert record["tflops"] == pytest.approx(0.01)
    assert measured["calls"] == ["float32"]
    assert record["mfu"] == pytest.approx(0.01 / 0.05)
    assert peak.tflops == 0.05 and "measured now" in peak.source
    assert json.loads(cache.read_text())[key]["tflops"] == 0.05


def test_mfu_is_never_reported_above_one(measured):
    # A CPU peak that the step still beats after measuring it again: MFU null, and the
    # peak's source (summary.json's peak_tflops_source) says why.
    measured["float32"] = (0.002, QUIET)
    peak = metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None)
    records = [metrics.step_record(s, 1.0, 1.0, 1e-3, 1.0, 10, 1, 1e9, peak, 0.1) for s in (1, 2)]
    assert [r["mfu"] for r in records] == [None, None]
    assert measured["calls"] == ["float32", "float32"]  # measured once more, not every step
    assert "MFU null" in peak.source
    # A peak stated in the config that a step beats: nothing to measure, MFU null too.
    given = metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, 0.005)
    beaten = metrics.step_record(1, 1.0, 1.0, 1e-3, 1.0, 10, 1, 1e9, given, 0.1)
    below = metrics.step_record(2, 1.0, 1.0, 1e-3, 1.0, 1, 1, 1e9, given, 0.1)
    assert beaten["mfu"] is None and below["mfu"] == pytest.approx(0.2)
    assert "MFU null" in given.source
    summary = metrics.steady_state([*records, beaten, below], warmup_steps=0)
    assert summary["median_mfu"] == pytest.approx(0.2)


def test_a_peak_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(
    measured, tmp_path, monkeypatch
):
    load_now = {"busy": BUSY}
    monkeypatch.setattr(cpu_peak, "machine_load", lambda ranks, age_s=None: load_now["busy"])
    measured["float32"] = (0.001, BUSY)
    first = metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None)
    # Still busy: the busy figure is reused (measuring again could do no better).
    again = metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None)
    assert first.tflops == again.tflops == 0.001 and measured["calls"] == ["float32"]
    assert "busy" in first.source and "busy" in again.source and "cached" in again.source
    # Quiet now: measured again, and the higher figure cached and reused.
    load_now["busy"] = QUIET
    measured["float32"] = (0.04, QUIET)
    assert metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None).tflops == 0.04
    assert metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None).tflops == 0.04
    assert measured["calls"] == ["float32"] * 2
    # A bare number (cached before loads were recorded, maybe on a busy machine) is measured
    # again.
    (tmp_path / "cpu_peak.json").write_text(json.dumps({cpu_peak.cpu_key("float32"): 0.0001}))
    assert metrics.resolve_peak(torch.device("cpu"), {"float32": 1.0}, None).tflops == 0.04
    assert measured["calls"] == ["float32"] * 3


def test_the_load_of_the_jobs_own_ranks_is_not_counted_as_busy(monkeypatch):
    monkeypatch.setattr(cpu_peak.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(cpu_peak.os, "cpu_count", lambda: 2)
    # 4 ranks runnable for a minute account for 4 x (1 - 1/e) = 2.53 of the 1-minute average.
    own = cpu_peak.machine_load(4, age_s=60.0)
    assert own.own_load == pytest.approx(2.528, abs=1e-3) and not own.busy
    # One process that just started: the 3.0 is someone else's.
    assert cpu_peak.machine_load(1, age_s=1.0).busy
    load = cpu_peak.MachineLoad(1000.0, 3.0, 0.0, 2)
    assert load.age(now=1000.0 + 7200) == "2.0 h ago"
    assert load.describe() == "load 3.00 of 2 CPUs (others 3.00), busy"


def test_this_machine_plan_remeasures_a_busy_peak_and_says_how_old_and_loaded_it_is(
    tmp_path, monkeypatch
):
    from omegaconf import OmegaConf

    from hsdp_runner.config.compose import CONF_DIR
    from hsdp_runner.config.schema import ClusterConfig
    from hsdp_runner.planner import cluster as cluster_mod
    from hsdp_runner.planner import linkbench, report

    monkeypatch.setattr(linkbench, "cache_path", lambda ranks: tmp_path / f"links_{ranks}.json")
    bench = {
        "peak_tflops": {"float32": 0.02},
        "links": {kind: {"2": [1e-3, 1e8]} for kind in linkbench.KINDS},
        "overlap": 0.3,
        "memory_gbps": 5.0,
        "memory_gib": 16.0,
        "threads_per_rank": linkbench._threads_per_rank(8),
    }
    busy = {"measured_at": 0.0, "loadavg": 7.0, "own_load": 0.2, "cpus": 2}
    (tmp_path / "links_8.json").write_text(json.dumps({**bench, "peak_load": busy}))
    calls = []
    monkeypatch.setattr(
        linkbench, "measure", lambda ranks: calls.append(ranks) or {**bench, "peak_load": quiet}
    )
    quiet = quiet_load()
    node = OmegaConf.load(CONF_DIR / "cluster" / "this_machine.yaml")
    typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), node))
    resolved = cluster_mod.resolve(typed, "float32")
    assert calls == [8] and resolved.peak_load == quiet  # the busy figure was measured again
    cluster_mod.resolve(typed, "float32")
    assert calls == [8]  # the quiet one is kept
    cfg = compose(["model=llama3_tiny", "cluster=this_machine"])
    lines = report._assumptions(cfg, resolved.describe())
    # Seconds since the measurement: 0 on an idle machine, more under CI's load (compose).
    age = re.search(r"- The peak was measured (\d+) s ago \(", lines)
    assert age and int(age.group(1)) < 60, lines
    assert "), load 0.00 of 2 CPUs (others 0.00).\n" in lines
    busy_line = report._assumptions(cfg, {**resolved.describe(), "peak_load": busy})
    assert "load 7.00 of 2 CPUs (others 6.80), busy: other processes kept" in busy_line


def test_the_cpu_model_comes_from_cpuinfo_without_starting_a_process(tmp_path, monkeypatch):
    """The CPU peak's cache key and a CPU run's ``device_name`` name the model from
    /proc/cpuinfo, else the architecture; never through ``platform.processor()``, which on
    Linux runs ``uname -p`` in a child process of the rank."""
    import platform
    import subprocess

    from hsdp_runner.distributed.hardware import cpu_model

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(platform, "_uname_cache", None)  # so processor() would run uname again
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Example CPU @ 2.00GHz\nflags\t: fpu\n")
    assert cpu_model(info) == "Example CPU @ 2.00GHz"
    assert cpu_model(tmp_path / "absent") == (platform.machine() or "cpu")
    assert f"|{cpu_model()}|" in cpu_peak.cpu_key("float32")
