"""benchmarks/plan_published.py on its data: the one constant per GPU comes back from the
figures marked fitted by the benchmark's own fit, and an interleaved pipeline figure is
planned at the stages per rank it ran."""

import importlib.util
from pathlib import Path

import pytest

from hsdp_runner import plan
from hsdp_runner.config.compose import to_run_config
from hsdp_runner.planner.cluster import resolve

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "plan_published", ROOT / "benchmarks" / "plan_published.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fit_on_the_fitted_figure_gives_the_h100_presets_efficiency(bench):
    """``fit_efficiency`` over the throughput figures marked fitted for ``h100_sxm`` (one:
    torchtitan's Llama 3.1 8B on 8 H100s, eager) gives the ``compute_efficiency`` the preset
    holds, within its rounding to 0.01 (0.521 -> 0.52). The A100's four MPT figures take about
    a minute on this machine: ``benchmarks/plan_published.py`` prints that fit beside its preset
    each run."""
    fitted = [
        case
        for case in bench.load()["throughput"]
        if case["cluster"] == "h100_sxm" and case["role"] == "fitted"
    ]
    assert [case["nodes"] for case in fitted] == [1]
    preset = resolve(to_run_config(plan.compose(["cluster=h100_sxm"])).cluster, "bfloat16")
    assert bench.fit_efficiency(fitted) == pytest.approx(preset.compute_efficiency, abs=0.005)


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
