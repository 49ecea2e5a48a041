"""benchmarks/plan_published.py on its data: sm90's one constant comes back from the one job
marked fitted (this runner's, measured on an H200: planner_gpu_heldout.py) by its own fit, no
published H100 figure is fitted, and an interleaved pipeline figure is planned at the stages per
rank it ran."""

import importlib.util
from pathlib import Path

import pytest

from hsdp_runner import plan
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.planner.cluster import resolve

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("plan_published")


def _preset_efficiency(cluster: str) -> float:
    cfg = plan.compose([f"cluster={cluster}"])
    return resolve(to_run_config(cfg).cluster, "bfloat16").compute_efficiency


def test_the_fit_on_the_fitted_h200_job_gives_the_sm90_presets_efficiency(bench):
    """``planner_gpu_heldout.fit_efficiency`` on its ``FITTED`` job (Llama-3 1B, bf16, no AC,
    batch 4 x 2,048, measured on one H200) gives the ``compute_efficiency`` the ``h200`` preset
    holds, within its rounding to 0.01 (0.957 -> 0.96), the planned step then within 1% of the
    measured one; ``h100_sxm`` (same sm90 kernels) holds the same constant, and none of its
    published figures is marked fitted. The A100's four MPT figures take about a minute on this
    machine: ``benchmarks/plan_published.py`` prints that fit beside its preset each run."""
    heldout = _load("planner_gpu_heldout")
    assert heldout.FITTED in heldout.JOBS
    efficiency = heldout.fit_efficiency()
    preset = _preset_efficiency("h200")
    assert efficiency == pytest.approx(preset, abs=0.005)
    assert _preset_efficiency("h100_sxm") == preset
    measured = heldout.measured_step_s(heldout.MEASURED, heldout.FITTED)
    predicted = heldout.predicted_step_s(heldout.FITTED, "h200")
    assert predicted == pytest.approx(measured, rel=0.01)
    fitted = [
        case["id"]
        for case in bench.load()["throughput"]
        if case["cluster"] in ("h100_sxm", "h200") and case["role"] == "fitted"
    ]
    assert fitted == []


def test_interleaved_pipeline_figures_are_planned_at_their_published_vpp(bench):
    """Every interleaved pipeline figure (throughput pairs and MoE) states its stages per rank
    (``vpp``) and its overrides set ``parallel.pp_stages_per_rank`` to it, which the planner
    prices (``pipeline.stages_per_rank``); a figure whose overrides would not carry it is
    refused before anything is planned."""
    data = bench.load()
    figures = data["moe_throughput"] + [f for p in data["pairs"] for f in p["figures"]]
    interleaved = [f for f in figures if f.get("pp_schedule", "").startswith("interleaved")]
    assert len(interleaved) > 20
    for case in interleaved:
        assert f"parallel.pp_stages_per_rank={case['vpp']}" in case["overrides"], case["id"]
    case = next(f for f in interleaved if f["vpp"] == 4)
    lost = {**case, "overrides": [o for o in case["overrides"] if "stages_per_rank" not in o]}
    cfg = plan.compose(lost["overrides"] + [f"cluster={case['cluster']}"])
    with pytest.raises(ValueError, match="vpp 4 is planned at 2 stages per rank"):
        bench.pipeline_row(lost, cfg, None)


@pytest.mark.parametrize("floor", [0.0, 0.9])
def test_efficiency_matching_finds_the_root_of_a_step_with_and_without_a_launch_floor(bench, floor):
    """A step of 0.6 / e + 0.1 (or that under a floor of 0.9 s, which bends it where e < 0.75):
    the efficiency whose step is 1.0 s is 0.6667 either way, found to rel_tol in a few
    predictions (bisection took 18); a step that no efficiency in range reaches is refused."""
    from hsdp_runner.core.errors import ConfigError

    calls = []

    def step_at(e):
        calls.append(e)
        return max(0.6 / e + 0.1, floor)

    found = bench.efficiency_matching(step_at, 1.0, rel_tol=1e-6)
    assert found == pytest.approx(2 / 3, rel=1e-6)
    assert len(calls) <= 8, calls
    with pytest.raises(ConfigError, match="not reached by compute_efficiency"):
        bench.efficiency_matching(step_at, 0.1)
