"""benchmarks/plan_published.py's mixture-of-experts section (benchmarks/plan_published_moe.py): each published MoE figure is
planned at its own degrees and ep (the runner layout of ``ep_layout`` where the published one
cannot hold its ep), none chose a constant, and a figure the runner refuses stays out of the
median."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("plan_published")


@pytest.fixture(scope="module")
def moe_bench():
    return _load("plan_published_moe")


def test_published_moe_figures_fix_their_degrees_and_ep(bench):
    """Every ``moe_throughput`` figure is planned with its ep and the layout that holds it:
    ``ep_layout`` where given, else ``layout``; the degrees times pp fill the GPUs it ran on,
    and ep divides the ranks it borrows from (dp_shard x cp x tp)."""
    for case in bench.load()["moe_throughput"]:
        fixed = bench._fixed_degrees(case)
        rep, shard, tp = case.get("ep_layout") or case["layout"]
        assert fixed == {
            "dp_replicate": rep,
            "dp_shard": shard,
            "cp": case.get("cp", 1),
            "tp": tp,
            "ep": case["ep"],
        }, case["id"]
        world = rep * shard * fixed["cp"] * tp * case.get("pp", 1)
        assert world == case["nodes"] * 8, case["id"]
        assert (shard * fixed["cp"] * tp) % case["ep"] == 0, case["id"]


def test_published_moe_figures_are_all_held_out(bench):
    """No MoE figure chose a constant; every pair names its figures by the table's ids (no copy
    of a figure to drift from it, as the pairs' copies once lacked the table's
    ``parallel.sp_save_shard``); every FP8 figure is planned compiled with the caveat that
    says why, and no bf16 one is compiled."""
    data = bench.load()
    figures = {c["id"]: c for c in data["moe_throughput"]}
    for case in data["moe_throughput"]:
        assert case["role"] == "held_out" and "fits" not in case, case["id"]
        assert case["source"] and case["table"] and case["setup"], case["id"]
        float8 = "precision=float8" in case["overrides"]
        assert ("parallel.compile=true" in case["overrides"]) is float8, case["id"]
        assert ("float8_compiled" in case["caveats"]) is float8, case["id"]
    for pair in data["moe_pairs"]:
        assert len(pair["figures"]) >= 2, pair["id"]
        for fig in pair["figures"]:
            assert isinstance(fig, str) and fig in figures, fig


def test_published_moe_summary_leaves_refused_figures_out_of_the_median(bench, moe_bench, capsys):
    """Three figures: two planned (errors -10% and +30%), one refused: the median is that of
    the two (20%), split by precision (the bf16 one's 10%, the float8 one's 30%), the refused
    one named with its reason, the fit count over the planned."""
    cases = [
        {"id": i, "role": "held_out", "tokens_per_s_per_gpu": 1000.0, "overrides": [precision]}
        for i, precision in (("a", "precision=bf16"), ("b", "precision=float8"), ("c", "x"))
    ]
    rows = {
        "a": {"tps_per_device": 900.0, "fits": True, "mem_gib": 70.0},
        "b": {"tps_per_device": 1300.0, "fits": False, "mem_gib": 90.0},
    }
    moe_bench._moe_summary({"moe_throughput": cases}, rows, {"c": "parallel.pp=9: no"})
    out = capsys.readouterr().out
    assert "2 figures planned, median |error| 20.0%" in out
    assert (
        "precision=bf16: median |error| 10.0% over 1; precision=float8: median |error| 30.0%" in out
    )
    assert "left out of the median: c: parallel.pp=9: no" in out
    assert "Fits where it ran: 1 of 2" in out and "b (90.0 GiB)" in out


def test_zero1_pipeline_figures_shard_their_state_over_every_data_parallel_rank(bench):
    """A ZeRO-1 figure under a pipeline is planned with FSDP over all its data-parallel ranks
    (dp_replicate 1: the optimizer's fp32 state sharded over every DP rank, as ZeRO-1 shards
    it) and its weights kept gathered through the step (``reshard_after_forward=false``, as
    ZeRO-1 keeps its bf16 weights whole), not as HSDP whose replicas each hold the experts'
    whole fp32 state."""
    planned = 0
    for case in bench.load()["moe_throughput"]:
        if case.get("pp", 1) == 1 or "zero1" not in case["caveats"]:
            continue
        planned += 1
        fixed = bench._fixed_degrees(case)
        replicas, shard, tp = case["layout"]
        assert fixed["dp_replicate"] == 1 and fixed["dp_shard"] == replicas * shard, case["id"]
        assert fixed["tp"] == tp, case["id"]
        assert "parallel.reshard_after_forward=false" in case["overrides"], case["id"]
    assert planned >= 20
